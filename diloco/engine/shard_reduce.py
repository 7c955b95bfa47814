"""Numbers about a sharded fragment that need every rank's shard: its hash and its norms.

Every rank of a sharded group calls these at the same point of the engine's control flow (they
are collectives over the group's process group, Gloo or NCCL). Each result is the same on every
rank of the group and does not depend on how the vector is cut, so groups of different sizes
(and an unsharded group) get the same number for the same values:

* ``group_fingerprint``: ``compress.fingerprint`` of the whole vector, from each rank's part of
  the sum (integer arithmetic mod 2^64);
* ``exact_sum_of_squares``: Σx² of fp32 values, exactly rounded: each x = m·2^e (m a 24-bit
  integer), x² = m²·2^(2e) summed as integers per exponent, reduced as integers and rounded once
  (what CO2's penalty needs, so that every group computes the same outer step);
* ``sum_of_squares``: Σx² in fp64 (a plain all-reduce; for reports, not for state).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from compress.fingerprint_parts import finish, rows_part

# frexp exponents of fp32: from -148 (2^-149 = 0.5·2^-148) to 128; bucket = exponent + _BIAS
_BIAS = 149
_BUCKETS = 128 + _BIAS + 1


def _all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def group_fingerprint(pieces: Sequence[tuple[torch.Tensor, int]], lengths: Sequence[int], group: Any) -> int:
    """The fingerprint of the whole tensors (``lengths``: their element counts, in order) whose
    ``pieces`` (values, stream offset) this rank holds; the other pieces are the other ranks'."""
    part = rows_part(pieces)
    mine = torch.tensor([part - (1 << 64) if part >> 63 else part], dtype=torch.int64)
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, mine, group=group)
        total = sum(int(p.item()) for p in parts)
    else:
        total = part
    return finish(total & ((1 << 64) - 1), lengths)


def _square_buckets(x: torch.Tensor) -> torch.Tensor:
    """[2, buckets] int64: per frexp exponent, the sums of the high and low 24 bits of m²."""
    out = torch.zeros(2, _BUCKETS, dtype=torch.int64)
    x = x.detach().reshape(-1).to("cpu", torch.float32)
    if not x.numel():
        return out
    mant, exp = torch.frexp(x)
    m = (mant.abs().double() * 16777216.0).to(torch.int64)  # the 24-bit integer mantissa
    sq = m * m  # < 2^48: exact
    idx = exp.to(torch.int64) + _BIAS
    out[0].index_add_(0, idx, sq >> 24)
    out[1].index_add_(0, idx, sq & 0xFFFFFF)
    return out


def exact_sum_of_squares(tensors: Sequence[torch.Tensor], group: Any = None) -> float:
    """Σx² over every element of ``tensors`` on every rank of ``group`` (None: this rank only),
    correctly rounded to fp64 whatever the order or cut; NaN if any value is not finite."""
    buckets = torch.zeros(2, _BUCKETS, dtype=torch.int64)
    finite = torch.ones(1, dtype=torch.int64)
    for t in tensors:
        if t.numel() and not bool(torch.isfinite(t).all()):
            finite.zero_()
            continue
        buckets += _square_buckets(t)
    _all_reduce_sum(buckets, group)
    if int(_all_reduce_sum(1 - finite, group).item()):
        return math.nan
    total = 0
    for b in range(_BUCKETS):  # m²·2^(2(b - BIAS) - 48) for every bucket, as one integer scaled up
        hi, lo = int(buckets[0, b]), int(buckets[1, b])
        if hi or lo:
            total += ((hi << 24) + lo) << (2 * b)
    # Σx² <= 2^256 · 2^40 elements, so the scaled integer stays below 2^(296 + 346): float() rounds once
    return math.ldexp(float(total), -2 * _BIAS - 48)


def sum_of_squares(tensors: Sequence[torch.Tensor], group: Any = None) -> float:
    """Σx² in fp64 over ``tensors`` on every rank of ``group`` (None: this rank only)."""
    local = sum((t.detach().double().square().sum() for t in tensors if t.numel()), torch.zeros((), dtype=torch.float64))
    return float(_all_reduce_sum(local.reshape(1).cpu(), group).item())
