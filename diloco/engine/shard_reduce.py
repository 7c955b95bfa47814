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


_CHUNK = 1 << 20  # elements per step of the reductions: their temporaries stay small (a few MiB)


def _comm_device(group: Any) -> torch.device:
    """Where a collective of ``group`` takes its tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` (on the CPU) summed over ``group`` (None or one rank: ``t`` itself)."""
    if group is not None and dist.get_world_size(group) > 1:
        on = t.to(_comm_device(group))
        dist.all_reduce(on, op=dist.ReduceOp.SUM, group=group)
        t = on.cpu()
    return t


def all_gather_cpu(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``t`` (a small CPU tensor, the same shape everywhere), in rank order, on the CPU."""
    if group is None or dist.get_world_size(group) == 1:
        return [t]
    on = t.to(_comm_device(group))
    parts = [torch.zeros_like(on) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, on, group=group)
    return [p.cpu() for p in parts]


def group_fingerprint(pieces: Sequence[tuple[torch.Tensor, int]], lengths: Sequence[int], group: Any) -> int:
    """The fingerprint of the whole tensors (``lengths``: their element counts, in order) whose
    ``pieces`` (values, stream offset) this rank holds; the other pieces are the other ranks'."""
    part = rows_part(pieces)
    mine = torch.tensor([part - (1 << 64) if part >> 63 else part], dtype=torch.int64)
    total = sum(int(p.item()) for p in all_gather_cpu(mine, group))
    return finish(total & ((1 << 64) - 1), lengths)


def _square_buckets(x: torch.Tensor) -> torch.Tensor:
    """[2, buckets] int64: per frexp exponent, the sums of the high and low 24 bits of m²."""
    out = torch.zeros(2, _BUCKETS, dtype=torch.int64, device=x.device)
    flat = x.detach().reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):  # integer sums: the same in any order or cut
        mant, exp = torch.frexp(flat[start:start + _CHUNK].to(torch.float32))
        m = (mant.abs().double() * 16777216.0).to(torch.int64)  # the 24-bit integer mantissa
        sq = m * m  # < 2^48: exact
        idx = exp.to(torch.int64) + _BIAS
        out[0].index_add_(0, idx, sq >> 24)
        out[1].index_add_(0, idx, sq & 0xFFFFFF)
    return out.cpu()


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
    """Σx² in fp64 over ``tensors`` on every rank of ``group`` (None: this rank only), a chunk
    at a time (no fp64 copy of a whole tensor)."""
    local = torch.zeros(1, dtype=torch.float64)
    for t in tensors:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            local += flat[start:start + _CHUNK].double().square().sum().cpu()
    return float(_all_reduce_sum(local, group).item())
