"""Stripe plan: cut a vector into stripes and give each group's stripes to its ranks by bandwidth.

Every rank of a group has its own NIC. The vector is cut into `num_stripes` near-equal stripes;
each stripe runs its own ring across groups, carried in every group by exactly one rank. Within a
group, stripes go to ranks so that the slowest rank finishes first: stripe after stripe goes to
the rank whose load would then take the least time, (count + 1) / bandwidth -- for identical
stripes this minimizes the group's finishing time. Each rank gets a contiguous run of stripes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .partition import segment_bounds


@dataclass(frozen=True)
class Stripe:
    """Elements [start, stop) of the vector; ranks[g] is the rank of group g that carries it."""

    index: int
    start: int
    stop: int
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StripePlan:
    """The stripes of one vector, in order; the same on every rank of every group."""

    num_elements: int
    stripes: tuple[Stripe, ...]
    group_sizes: tuple[int, ...]

    def stripes_of(self, group: int, rank: int) -> list[Stripe]:
        """The stripes that rank `rank` of group `group` carries, in vector order."""
        return [s for s in self.stripes if s.ranks[group] == rank]

    def elements_of(self, group: int, rank: int) -> int:
        """How many elements rank `rank` of group `group` carries."""
        return sum(s.size for s in self.stripes_of(group, rank))

    def ring(self, stripe: int, addresses: list[list[str]], order: list[int] | None = None) -> list[str]:
        """Ring of a stripe: addresses[g][r] is rank r of group g; `order` lists groups in ring order."""
        s = self.stripes[stripe]
        return [addresses[g][s.ranks[g]] for g in (order if order is not None else range(len(self.group_sizes)))]


def apportion(num_items: int, bandwidths: list[float]) -> list[int]:
    """Counts of identical items per rank minimizing max(count / bandwidth); sums to num_items."""
    if not bandwidths:
        raise ValueError("a group needs at least one rank")
    for b in bandwidths:
        if not (isinstance(b, (int, float)) and math.isfinite(b) and b >= 0):
            raise ValueError(f"bandwidths must be finite and >= 0, got {bandwidths}")
    if not any(b > 0 for b in bandwidths):
        raise ValueError(f"a group needs a rank with bandwidth > 0, got {bandwidths}")
    counts = [0] * len(bandwidths)
    for _ in range(num_items):
        best = min((r for r, b in enumerate(bandwidths) if b > 0), key=lambda r: ((counts[r] + 1) / bandwidths[r], r))
        counts[best] += 1
    return counts


def stripe_plan(num_elements: int, rank_bandwidths: list[list[float]], num_stripes: int,
                align: int = 1) -> StripePlan:
    """Plan the stripes of a num_elements vector.

    rank_bandwidths[g][r]: measured bandwidth of rank r of group g (any unit, bytes/s say; only
    ratios within a group matter; 0 = carries nothing). Groups may have different rank counts.
    num_stripes: how many stripes (more stripes = finer balance, more rings). Stripes may be
    empty when num_elements < num_stripes. align: every stripe starts at a multiple of it (a
    codec's chunk, so that its chunks are the caller's: SparseLoCo's tiles).
    """
    if num_elements < 0:
        raise ValueError(f"num_elements must be >= 0, got {num_elements}")
    if num_stripes < 1:
        raise ValueError(f"num_stripes must be >= 1, got {num_stripes}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if not rank_bandwidths:
        raise ValueError("need at least one group")
    owners: list[list[int]] = []
    for bws in rank_bandwidths:
        counts = apportion(num_stripes, list(bws))
        owners.append([r for r, c in enumerate(counts) for _ in range(c)])
    bounds = [(min(a * align, num_elements), min(b * align, num_elements))
              for a, b in segment_bounds(-(-num_elements // align), num_stripes)]
    stripes = tuple(
        Stripe(k, a, b, tuple(owners[g][k] for g in range(len(rank_bandwidths)))) for k, (a, b) in enumerate(bounds)
    )
    return StripePlan(num_elements, stripes, tuple(len(b) for b in rank_bandwidths))
