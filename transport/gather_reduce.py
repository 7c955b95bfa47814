"""The reduction of one gathered chunk: every member's decoded contribution to their mean.

Pure functions over the decoded chunks (no sockets), run by every member of an all-gather on the
same decoded bits in the same (ring-index) order, so every member gets bit-identical results on
any device and any number of threads: only exactly rounded elementwise fp32 operations on the
vectors, and the clip's norms are summed in a fixed order (below). Which reduction a gather
runs is its codec's (``compress.gather_rule``: ``codec.mean``, ``codec.clip_median``):

* ``mean_over_all`` (``MEAN_ALL``): ``sum_i(s_i * d_i) / G``;
* ``mean_over_senders`` (``MEAN_SENDERS``): per index, ``sum_i(s_i * d_i) / sum_i(s_i * [d_i != 0])``
  over the groups whose decoded value there is nonzero (a sent value that decodes to exactly 0
  adds nothing to the sum and is not counted); 0 where none sent a value. With every weight 1
  (the unweighted mean) the divisor is the count of senders, as the SparseLoCo authors'
  ``scatter_reduce(reduce="mean", include_self=False)``;
* ``clip_to_median_norm``: before either, each contribution with weight > 0 whose L2 norm is above
  the median of those contributions' norms is scaled down to it. The median of an even count is
  the lower of the two middle norms (as ``torch.median``, which the authors' clip calls).

``s_i``: each member's weight (1 when not given; applied only when not 1). Non-finite values
(NaN, Inf) pass through every rule as they do through the plain mean (the clip is skipped when a
norm is not finite), so whoever checks the mean for them still refuses it.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from compress.gather_rule import MEAN_ALL, MEAN_SENDERS


def mean_over_all(decoded: list[torch.Tensor], scales: list[float] | None, out: torch.Tensor) -> torch.Tensor:
    """``out = sum_i(s_i · decoded[i]) / G`` in index order, in fp32, without changing the inputs
    (a scale of exactly 1 is not applied). G divides as a 0-dim tensor on out's device: CUDA would
    divide by a CPU scalar through its reciprocal, not exactly as the CPU does (see RingAllReduce._g)."""
    g = torch.full((), float(len(decoded)), dtype=torch.float32, device=out.device)
    return _weighted_sum(decoded, scales, out).div_(g)


def mean_over_senders(decoded: list[torch.Tensor], scales: list[float] | None, out: torch.Tensor) -> torch.Tensor:
    """Each index's weighted mean over the members whose decoded value there is nonzero:
    ``out = sum_i(s_i · d_i) / sum_i(s_i · [d_i != 0])`` in index order, in fp32; 0 where no member
    with a weight above 0 sent a value. Without scales the divisor is the count of senders."""
    _weighted_sum(decoded, scales, out)
    weight = torch.zeros_like(out)
    for i, d in enumerate(decoded):
        s = 1.0 if scales is None else scales[i]
        sent = (d != 0).to(torch.float32)
        weight.add_(sent if s == 1.0 else sent * s)
    # where nothing was sent the sum is a zero (s_i · 0): dividing it by 1 keeps it
    weight.masked_fill_(weight == 0, 1.0)
    return out.div_(weight)


def _weighted_sum(decoded: list[torch.Tensor], scales: list[float] | None, out: torch.Tensor) -> torch.Tensor:
    """``out = sum_i(s_i · decoded[i])`` in index order (a scale of exactly 1 is not applied)."""
    for i, d in enumerate(decoded):
        s = 1.0 if scales is None else scales[i]
        if i == 0:
            if s == 1.0:
                out.copy_(d)
            else:
                torch.mul(d, s, out=out)
        else:
            out.add_(d if s == 1.0 else d * s)
    return out


def norms_in_fixed_order(decoded: list[torch.Tensor]) -> list[float]:
    """Each vector's L2 norm, the same number on every device and thread count: the squares in
    float64 (exact for fp32 values), summed pairwise in a fixed tree (halves added elementwise,
    zero-padded to a power of two), then a correctly rounded square root. The vectors have one length."""
    n = decoded[0].numel() if decoded else 0
    if any(d.numel() != n for d in decoded):
        raise ValueError(f"contributions of different lengths: {[d.numel() for d in decoded]}")
    if n == 0:
        return [0.0] * len(decoded)
    width = 1 << (n - 1).bit_length()
    squares = torch.zeros((len(decoded), width), dtype=torch.float64, device=decoded[0].device)
    for row, d in zip(squares, decoded):
        row[:n].copy_(d)
    squares.mul_(squares)
    while width > 1:
        width //= 2
        squares = squares[:, :width] + squares[:, width:]
    return [math.sqrt(s) for s in squares[:, 0].tolist()]


def median_norm(norms: list[float]) -> float:
    """The median of ``norms`` (not empty); of an even count the lower of the two middle ones."""
    ordered = sorted(norms)
    return ordered[(len(ordered) - 1) // 2]


def clip_to_median_norm(decoded: list[torch.Tensor], scales: list[float] | None) -> list[torch.Tensor]:
    """The contributions with each one of weight > 0 whose norm is above the median of their norms
    scaled by ``median / norm`` (that factor rounded to fp32 once, then one fp32 multiply); the
    others as given (the same tensors). Nothing is clipped when a norm is not finite."""
    norms = norms_in_fixed_order(decoded)
    live = [n for i, n in enumerate(norms) if scales is None or scales[i] > 0]
    if not live or not all(math.isfinite(n) for n in norms):
        return list(decoded)
    median = median_norm(live)
    out = []
    for i, (d, n) in enumerate(zip(decoded, norms)):
        if n > median and (scales is None or scales[i] > 0):
            factor = torch.tensor(median / n, dtype=torch.float32).item()  # a float32 value: exact in the multiply
            out.append(d * factor)
        else:
            out.append(d)
    return out


def reduce_gathered(decoded: list[torch.Tensor], scales: list[float] | None, out: torch.Tensor,
                    codec: Any = None) -> torch.Tensor:
    """The mean the codec's gather rule asks for (``codec.mean``, ``codec.clip_median``, attributes
    of every ``compress.Codec``; None: ``mean_over_all``) of the decoded chunks, written into ``out``.
    ``scales`` as ``transport.gather.check_scales`` passes them (finite, >= 0, one per chunk)."""
    if not decoded:
        raise ValueError("no contributions to reduce")
    mean, clip = (MEAN_ALL, False) if codec is None else (codec.mean, codec.clip_median)
    if clip:
        decoded = clip_to_median_norm(decoded, scales)
    if mean == MEAN_ALL:
        return mean_over_all(decoded, scales, out)
    if mean == MEAN_SENDERS:
        return mean_over_senders(decoded, scales, out)
    raise ValueError(f"codec {getattr(codec, 'name', codec)!r} asks for an unknown mean {mean!r}")
