"""How sharded groups exchange a fragment: one ring per shard, also between groups of other sizes.

In a sharded group (FSDP2) rank r holds dim-0 row ranges of every parameter
(``diloco.engine.shard_layout``). Groups of equal size hold the same ranges on the same rank, so
rank r of every group averages its whole shard with rank r of the others: one exchange per shard,
over each rank's own NIC, and nothing to share inside the group afterwards.

Groups of different sizes cut each parameter at different rows. The plan takes every group's cut
points together: each parameter splits into *segments* that every group holds on exactly one rank,
and the segments with the same holder in every group (the same tuple of ranks, one per group) form
a *cell*. A cell is averaged by one ring among its holders, so every element still crosses the
WAN once per group and every rank sends only what it holds: a rank's cross-group bytes are its
shard's share of the fragment, whatever the other groups' sizes. With a 2-rank group beside a
4-rank one, rank 0 of the 2-rank group takes part in two rings (with ranks 0 and 1 of the other),
each over half of its shard.

A rank's cells, one after the other, make its *exchange order* of its shard's elements: the rings
run on contiguous slices of that order, cut into ``stripes_per_cell`` stripes each (rings in
parallel, as the unsharded exchange's stripes), and the mean is put back in the shard's own order
afterwards. With equal sizes the exchange order is the shard's own (no copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco.engine.shard_layout import ShardLayout
from transport import Stripe
from transport.partition import segment_bounds


@dataclass(frozen=True)
class ShardExchangePlan:
    """One rank's part of a sharded exchange among groups of sizes ``group_sizes``.

    ``stripes``: the rings this rank joins, with [start, stop) in its exchange order and the rank
    of each group that carries them. ``runs``: (start, stop) ranges of the shard, in the shard's
    own order, whose concatenation is the exchange order (``identity``: a single run)."""

    group_sizes: tuple[int, ...]
    stripes: tuple[Stripe, ...]
    runs: tuple[tuple[int, int], ...]
    numel: int  # elements of this rank's shard

    @property
    def identity(self) -> bool:
        """The exchange order is the shard's own order."""
        return self.runs in ((), ((0, self.numel),))

    def ring(self, stripe: Stripe, addresses: list[list[str]], order: list[int]) -> list[str]:
        """The ring of one of this plan's stripes: ``addresses[g][r]`` is rank r of group g (groups
        in the plan's order); ``order``: the groups in ring order."""
        return [addresses[g][stripe.ranks[g]] for g in order]

    def to_exchange_order(self, shard: torch.Tensor) -> torch.Tensor:
        """The shard's elements in exchange order (the shard itself when that is its order)."""
        if self.identity:
            return shard
        return torch.cat([shard[a:b] for a, b in self.runs]) if self.runs else shard[:0].clone()

    def to_shard_order(self, values: torch.Tensor) -> torch.Tensor:
        """Undo ``to_exchange_order``."""
        if self.identity:
            return values
        out = torch.empty_like(values)
        at = 0
        for a, b in self.runs:
            out[a:b] = values[at:at + b - a]
            at += b - a
        return out


def _owner(row: int, rows: int, size: int) -> int:
    """The rank of a ``size``-rank group that holds ``row`` of a ``rows``-row parameter."""
    return row // -(-rows // size)


def shard_exchange_plan(layout: ShardLayout, group_sizes: list[int], me: int, stripes_per_cell: int = 4) \
        -> ShardExchangePlan:
    """The plan of rank ``layout.rank`` of group ``me`` (an index into ``group_sizes``, whose size
    must be ``layout.size``) for a fragment laid out as ``layout`` in every group (see module doc).
    The same cells, in the same order and cut into the same stripes, on every rank of every group."""
    if not 0 <= me < len(group_sizes) or group_sizes[me] != layout.size:
        raise ValueError(f"group index {me} of sizes {group_sizes}: its size must be this layout's {layout.size}")
    if any(s < 1 for s in group_sizes):
        raise ValueError(f"every group needs at least one rank, got sizes {group_sizes}")
    if stripes_per_cell < 1:
        raise ValueError(f"stripes_per_cell must be >= 1, got {stripes_per_cell}")
    cells: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # holders -> this rank's (local start, length)
    local_base = 0
    for i, (rows, per_row) in enumerate(layout.shapes):
        cuts = sorted({min(k * -(-rows // size), rows) for size in group_sizes for k in range(size + 1)})
        mine_lo, mine_hi = layout.rows_of(i)
        for a, b in zip(cuts, cuts[1:]):
            if b <= a:
                continue
            holders = tuple(_owner(a, rows, size) for size in group_sizes)
            cell = cells.setdefault(holders, [])
            if holders[me] == layout.rank:
                cell.append((local_base + (a - mine_lo) * per_row, (b - a) * per_row))
        local_base += (mine_hi - mine_lo) * per_row
    stripes: list[Stripe] = []
    runs: list[tuple[int, int]] = []
    at = 0
    for index, holders in enumerate(sorted(cells)):  # every rank enumerates every cell: same indices
        if holders[me] != layout.rank:
            continue
        length = 0
        for start, n in cells[holders]:
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + n)
            else:
                runs.append((start, start + n))
            length += n
        for j, (a, b) in enumerate(segment_bounds(length, min(stripes_per_cell, max(length, 1)))):
            stripes.append(Stripe(index * stripes_per_cell + j, at + a, at + b, holders))
        at += length
    if at != local_base:
        raise AssertionError(f"the plan covers {at} of this rank's {local_base} elements")
    return ShardExchangePlan(tuple(group_sizes), tuple(stripes), tuple(runs), local_base)
