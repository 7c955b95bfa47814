"""Which elements of a fragment each rank of a sharded (FSDP2) group holds.

``torch.distributed.fsdp.fully_shard`` turns every parameter into a DTensor sharded on dim 0 over
the group's ranks, the way ``torch.chunk`` cuts it: with ``n`` rows over ``W`` ranks, each rank
holds ``c = ceil(n / W)`` rows, rank r the rows ``[min(r·c, n), min((r+1)·c, n))`` (the last
ranks may hold fewer, or none). The engine's flat vector of a fragment is its parameters
flattened in order; a rank's *local* vector is the concatenation of the pieces it holds, in the
same order. ``ShardLayout`` says which global ranges those pieces are, for this group's size and
for any other (the exchange meets groups of other sizes on overlapping ranges:
``diloco.exchange.shard_plan``). ``describe`` reads the layout off a fragment's DTensors and
refuses shardings it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class ShardLayout:
    """The dim-0 sharding of one fragment over ``size`` ranks, seen from ``rank``.

    ``shapes[i]``: (rows, elements per row) of parameter i, in the fragment's order."""

    shapes: tuple[tuple[int, int], ...]
    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size} ranks: need 0 <= rank < size, size >= 1")
        for rows, per_row in self.shapes:
            if rows < 0 or per_row < 0:
                raise ValueError(f"a parameter of {rows} rows of {per_row} elements: need both >= 0")

    @property
    def numel(self) -> int:
        """Elements of the whole fragment (every rank's pieces together)."""
        return sum(rows * per_row for rows, per_row in self.shapes)

    def offsets(self) -> list[int]:
        """Global offset of each parameter in the fragment's flat vector."""
        out, at = [], 0
        for rows, per_row in self.shapes:
            out.append(at)
            at += rows * per_row
        return out

    def rows_of(self, i: int, size: int | None = None, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) rows of parameter i that ``rank`` of a ``size``-rank group holds (default:
        this group, this rank)."""
        size = self.size if size is None else size
        rank = self.rank if rank is None else rank
        rows = self.shapes[i][0]
        per_rank = -(-rows // size)
        return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)

    def pieces(self, size: int | None = None, rank: int | None = None) -> list[tuple[int, int]]:
        """Global [start, stop) of each parameter's piece held by ``rank`` of ``size`` (in order;
        empty pieces included), this rank of this group by default."""
        out = []
        for i, base in enumerate(self.offsets()):
            lo, hi = self.rows_of(i, size, rank)
            per_row = self.shapes[i][1]
            out.append((base + lo * per_row, base + hi * per_row))
        return out

    def local_numel(self, size: int | None = None, rank: int | None = None) -> int:
        """Elements ``rank`` of ``size`` holds (this rank of this group by default)."""
        return sum(b - a for a, b in self.pieces(size, rank))


class ShardingError(ValueError):
    """A model's sharding is not one the engine can exchange per shard (the message says why)."""


def is_sharded(params: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a DTensor (a sharded model)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def local_view(p: torch.Tensor) -> torch.Tensor:
    """The part of parameter ``p`` this rank holds, as a plain tensor sharing its storage (the
    parameter itself when it is not a DTensor)."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def describe(names: Sequence[str], params: Sequence[torch.Tensor]) -> tuple[ShardLayout, Any]:
    """The layout of one fragment's DTensor parameters and the process group they are sharded
    over. Every parameter must be sharded on dim 0 over one 1-D device mesh (what ``fully_shard``
    does on a 1-D mesh by default): ``ShardingError`` names the first one that is not."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = None
    shapes = []
    for name, p in zip(names, params):
        if not isinstance(p, DTensor):
            raise ShardingError(f"parameter {name!r} is not sharded while others are: apply fully_shard to the "
                                "root module too, so that every trainable parameter is a DTensor")
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ShardingError(f"parameter {name!r} is placed {tuple(p.placements)} on a {p.device_mesh.ndim}-D "
                                "mesh; the engine exchanges dim-0 shards on a 1-D mesh only (fully_shard's "
                                "default; HSDP and shard_placement_fn other than Shard(0) are not supported)")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ShardingError(f"parameter {name!r} is sharded over another device mesh than {names[0]!r}")
        if p.dim() == 0:
            raise ShardingError(f"parameter {name!r} is a scalar: it cannot be sharded on dim 0")
        rows = p.shape[0]
        shapes.append((rows, p.numel() // rows if rows else 0))
    assert mesh is not None
    layout = ShardLayout(tuple(shapes), mesh.size(), mesh.get_local_rank())
    for (name, p), (a, b) in zip(zip(names, params), layout.pieces()):
        if local_view(p).numel() != b - a:
            raise ShardingError(f"parameter {name!r}: this rank holds {local_view(p).numel()} elements, the "
                                f"dim-0 chunk rule says {b - a}: an uneven sharding the engine does not know")
    return layout, mesh
