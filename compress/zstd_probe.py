"""Decide per link whether the zstd stage pays: measure it on a sample of real data."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import entropy, frame
from .codec import Codec
from .registry import get_codec


@dataclass(frozen=True)
class ZstdMeasurement:
    """Sizes and CPU times of one codec with and without zstd on one sample."""

    codec: str
    elements: int
    plain_bytes: int        # frame bytes without zstd
    zstd_bytes: int         # frame bytes with zstd
    extra_encode_s: float   # added encode time per frame with zstd (seconds)
    extra_decode_s: float   # added decode time per frame with zstd (seconds)

    @property
    def ratio(self) -> float:
        """plain_bytes / zstd_bytes (> 1 means zstd shrinks the frame)."""
        return self.plain_bytes / max(1, self.zstd_bytes)

    def pays(self, link_bytes_per_s: float) -> bool:
        """True if the wire time saved on a link of this bandwidth (bytes/s) exceeds the extra
        CPU time zstd costs at both ends (the conservative, unpipelined view)."""
        saved = (self.plain_bytes - self.zstd_bytes) / link_bytes_per_s
        return saved > self.extra_encode_s + self.extra_decode_s

    def pays_pipelined(self, link_bytes_per_s: float) -> bool:
        """True if zstd shortens an exchange whose chunks are pipelined (the rings: one chunk is
        compressed or decompressed while others are on the wire): the smaller frames' wire time
        and the zstd stage's CPU time each stay below the plain frames' wire time."""
        plain_s = self.plain_bytes / link_bytes_per_s
        return max(self.zstd_bytes / link_bytes_per_s, self.extra_encode_s + self.extra_decode_s) < plain_s


def _best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_zstd(codec: Codec, sample: torch.Tensor, repeat: int = 5) -> ZstdMeasurement:
    """Frame sizes of ``sample`` (1-D fp32) with and without zstd, and the best-of-``repeat``
    CPU time of the zstd stage itself (shuffle + compress, decompress + unshuffle)."""
    params = {k: v for k, v in codec.params.items() if k != "zstd"}
    plain = get_codec(codec.name, **params, zstd=False)
    packed = get_codec(codec.name, **params, zstd=True)
    f0, f1 = plain.encode(sample), packed.encode(sample)
    raw = torch.frombuffer(bytearray(f0[frame.HEADER_SIZE:-frame.TRAILER_SIZE]), dtype=torch.uint8)
    width, level = plain.shuffle_width, packed.zstd_level

    def squeeze() -> bytes:
        return entropy.compress(memoryview(entropy.shuffle(raw, width).numpy()), level)

    small = squeeze()

    def expand() -> torch.Tensor:
        out = entropy.decompress(memoryview(small), raw.numel())
        return entropy.unshuffle(torch.frombuffer(bytearray(out), dtype=torch.uint8), width)

    return ZstdMeasurement(codec.name, sample.numel(), len(f0), len(f1),
                           _best_time(squeeze, repeat), _best_time(expand, repeat))
