"""The fingerprint of a vector whose pieces live on different processes (a sharded model).

``compress.fingerprint`` is a sum mod 2^64 over the stream's words (each weighted by its row and
column) plus a term per tensor length, avalanched at the end. So each process can sum the words
it holds at their stream offsets (``rows_part``), the parts are added (in any order: integer
addition mod 2^64), and ``finish`` adds the lengths term and avalanches. For the same values the
result is the same number as ``fingerprint`` of the whole tensors, however they are cut.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .codecs import blockwise
from .fingerprint import (
    _K1_U32,
    _K2_U32,
    _STEP_WORDS,
    _STEP_WORDS_ELSEWHERE,
    MASK64,
    _avalanche,
    _stream_torch,
    tensor_weight,
)


def rows_part(pieces: Sequence[tuple[torch.Tensor, int]], native: bool = True) -> int:
    """Sum mod 2^64 of the row terms of ``pieces``: (fp32 values, offset of their first word in
    the whole stream). Pieces must not overlap; empty pieces add nothing."""
    total = 0
    for t, start in pieces:
        if start < 0:
            raise ValueError(f"a piece's stream offset must be >= 0, got {start}")
        x = t.detach()
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        x = x.contiguous().reshape(-1)
        if not x.numel():
            continue
        if x.device.type == "cpu" and native and blockwise.native_available():
            total += blockwise._native.fingerprint32(x.data_ptr(), x.numel(), start, _K1_U32.data_ptr(),
                                                     _K2_U32.data_ptr())
        else:
            step = _STEP_WORDS.get(x.device.type, _STEP_WORDS_ELSEWHERE)
            total += int(_stream_torch([x], start, step).item())
    return total & MASK64


def finish(rows_sum: int, lengths: Sequence[int]) -> int:
    """The fingerprint from the sum of every piece's ``rows_part`` and the whole tensors'
    lengths, in order: equal to ``fingerprint`` of the whole tensors."""
    h = rows_sum + sum(n * tensor_weight(i) for i, n in enumerate(lengths))
    return _avalanche(h & MASK64)
