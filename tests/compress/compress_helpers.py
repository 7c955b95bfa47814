"""Shared fixtures for the compress tests: small frames of every codec."""
from __future__ import annotations

import torch

import compress

REQUIRED = ["fp32", "bf16", "int8", "int4", "fp4-e2m1", "fp4-e3m0", "lloyd4", "int2", "sign1", "topk"]

# small-parameter variants so that short tensors still span several blocks / chunks
SMALL = {
    "fp32": {}, "bf16": {}, "fp16": {},
    "int8": {"block_size": 16}, "int4": {"block_size": 8},
    "fp4-e2m1": {"block_size": 8}, "fp4-e3m0": {"block_size": 8}, "lloyd4": {"block_size": 8},
    "int2": {"block_size": 8}, "sign1": {"block_size": 8}, "topk": {"chunk": 16, "k": 3, "value_bits": 3},
}


def sample_frames(seed: int = 0) -> list[bytes]:
    """A few valid frames of every codec, with and without zstd, including empty ones."""
    g = torch.Generator().manual_seed(seed)
    frames = []
    for name in compress.available_codecs():
        for zstd in (False, True):
            codec = compress.get_codec(name, zstd=zstd, **SMALL[name])
            for n in (0, 1, 13, 40):
                frames.append(codec.encode(torch.randn(n, generator=g)))
    return frames
