"""Entropy stage: optional byte-shuffle and zstd over one frame's payload.

Each frame is compressed independently (no shared dictionary or stream state), so frames can be
decoded in any order and lost frames cost nothing else.
"""
from __future__ import annotations

import os
import threading

import torch
import zstandard

from .errors import FrameError

#: Payloads at least this large are compressed with several zstd worker threads.
MT_THRESHOLD = 4 << 20
#: zstd cannot expand more than this (an RLE block: 4 bytes -> 128 KiB); bounds a declared raw_len.
MAX_ZSTD_RATIO = 1 << 15
_local = threading.local()


def _threads_for(nbytes: int) -> int:
    if nbytes < MT_THRESHOLD:
        return 0
    return max(0, min(os.cpu_count() or 1, nbytes // MT_THRESHOLD))


def _compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    key = (level, threads)
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(level=level, threads=threads, write_content_size=True)
    return cache[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


_WORD = {2: torch.int16, 4: torch.int32}


def _native_transpose(payload: torch.Tensor, width: int, inverse: bool) -> torch.Tensor | None:
    """The byte transpose by compress/_native.c (same bytes as the torch path below), None where
    it is not built or not enabled (``compress.codecs.blockwise.USE_NATIVE``), for a GPU tensor, or
    for words wider than the kernel's 8 bytes (no codec's: they shuffle 2- and 4-byte words)."""
    from .codecs import blockwise  # imported here: the codecs import this module

    if payload.device.type != "cpu" or not blockwise.native_available() or width > 8:
        return None
    payload = payload.contiguous()
    n = payload.numel() // width
    out = torch.empty_like(payload)
    kernel = blockwise._native.unshuffle if inverse else blockwise._native.shuffle
    kernel(payload.data_ptr(), out.data_ptr(), n, width)
    out[n * width:] = payload[n * width:]
    return out


def shuffle(payload: torch.Tensor, width: int) -> torch.Tensor:
    """Byte-transpose a uint8 payload of ``width``-byte little-endian words (all byte 0s, then
    all byte 1s, ...) into a new tensor. Bytes past the last whole word stay in place at the end."""
    if width <= 1:
        return payload
    native = _native_transpose(payload, width, inverse=False)
    if native is not None:
        return native
    n = payload.numel() // width
    out = torch.empty_like(payload)
    if width in _WORD:
        words = payload[:n * width].view(_WORD[width])
        for k in range(width):  # narrowing to uint8 keeps the low byte of each shifted word
            out[k * n:(k + 1) * n].copy_(words >> (8 * k) if k else words)
    else:
        out[:n * width].copy_(payload[:n * width].view(n, width).t().reshape(-1))
    out[n * width:] = payload[n * width:]
    return out


def unshuffle(payload: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`shuffle` (a new tensor)."""
    if width <= 1:
        return payload
    native = _native_transpose(payload, width, inverse=True)
    if native is not None:
        return native
    n = payload.numel() // width
    out = torch.empty_like(payload)
    if width in _WORD:
        dt = _WORD[width]
        words = payload[:n].to(dt)
        for k in range(1, width):
            words |= payload[k * n:(k + 1) * n].to(dt) << (8 * k)
        out[:n * width].copy_(words.view(torch.uint8))
    else:
        out[:n * width].copy_(payload[:n * width].view(width, n).t().reshape(-1))
    out[n * width:] = payload[n * width:]
    return out


def compress(data: memoryview | bytes, level: int) -> bytes:
    """zstd-compress one payload (multi-threaded when it is large)."""
    return _compressor(level, _threads_for(len(data))).compress(data)


def decompress(data: memoryview, raw_len: int) -> bytes:
    """Decompress one payload that must expand to exactly ``raw_len`` bytes, else FrameError.

    ``raw_len`` is bounded by zstd's maximum expansion of ``len(data)`` before any allocation.
    """
    if raw_len > MAX_ZSTD_RATIO * len(data) + 1024:
        raise FrameError(f"header claims {raw_len} raw bytes from a {len(data)}-byte zstd payload, "
                         "more than zstd can expand to")
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise FrameError(f"zstd payload has a bad frame header: {e}") from None
    if size != raw_len:
        raise FrameError(f"zstd frame declares {size} content bytes but the header says {raw_len}")
    try:  # one zstd frame and nothing after it: the header's wire length is the frame's
        out = _decompressor().decompress(data, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FrameError(f"zstd payload does not decompress: {e}") from None
    if len(out) != raw_len:
        raise FrameError(f"zstd payload decompressed to {len(out)} bytes, header says {raw_len}")
    return out
