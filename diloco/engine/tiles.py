"""SparseLoCo's chunks: every 2-D tensor in 64 x 64 tiles, every 1-D tensor in runs of 4096.

Top-k chooses the k largest values of each chunk of ``tile * tile`` values; for that to be
SparseLoCo's chunking (docs/algorithms.md §8.2), a fragment's flat vector is laid out tile-major
before it is encoded: each 2-D tensor (a tensor of more dimensions is seen as its first dimension
by the rest) is cut into ``tile x tile`` tiles in row-major order, each tile's values row-major,
and each tile (an edge tile too, its missing rows and columns as zeros) takes a whole chunk; a
1-D tensor (or a scalar)
takes ``ceil(n / chunk)`` chunks, the last zero-padded. So every chunk the codec sees is one
tile or one run, whatever the tensors' shapes. ``TileLayout`` is pure index arithmetic: the same
permutation on every group, built once per fragment.
"""

from __future__ import annotations

from typing import Sequence

import torch

from diloco.engine.averaging import refused

TILE = 64


class TileLayout:
    """The tile-major order of the concatenated tensors of ``shapes`` (a fragment's parameters)."""

    def __init__(self, shapes: Sequence[Sequence[int]], tile: int = TILE) -> None:
        if tile < 1:
            raise ValueError(f"tile must be >= 1, got {tile}")
        self.tile, self.chunk = tile, tile * tile
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        sources: list[torch.Tensor] = []  # per tensor: the flat position of each tile-major slot (-1: padding)
        offset = 0
        for shape in self.shapes:
            numel = 1
            for d in shape:
                numel *= d
            sources.extend(self._chunks(shape, numel, offset))
            offset += numel
        self.numel = offset
        source = torch.cat(sources) if sources else torch.empty(0, dtype=torch.int64)
        self.padded_numel = source.numel()
        real = source >= 0
        self._targets = real.nonzero().squeeze(1)  # tile-major positions of real values (int64: 16 B
        self._from = source[real]  # a parameter for the two) ... and the flat positions they come from

    def _chunks(self, shape: tuple[int, ...], numel: int, offset: int) -> list[torch.Tensor]:
        t, c = self.tile, self.chunk
        if not numel:
            return []
        if len(shape) >= 2:
            rows, cols = shape[0], numel // shape[0]
            tiles_across = -(-cols // t)
            r = torch.arange(rows, dtype=torch.int64)[:, None]
            q = torch.arange(cols, dtype=torch.int64)[None, :]
            slot = ((r // t) * tiles_across + q // t) * c + (r % t) * t + q % t  # an edge tile has holes
            source = torch.full((-(-rows // t) * tiles_across * c,), -1, dtype=torch.int64)
            source[slot.reshape(-1)] = torch.arange(numel, dtype=torch.int64) + offset
            return [source]
        flat = torch.arange(numel, dtype=torch.int64) + offset
        return [torch.cat([flat, flat.new_full((-numel % c,), -1)])]

    def to_tiles(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (this layout's ``numel`` values) in tile-major order, ``padded_numel`` long."""
        if flat.numel() != self.numel:
            raise ValueError(f"expected {self.numel} values, got {flat.numel()}")
        out = flat.new_zeros(self.padded_numel)
        out[self._targets.to(flat.device)] = flat[self._from.to(flat.device)]
        return out

    def from_tiles(self, tiled: torch.Tensor) -> torch.Tensor:
        """Inverse of ``to_tiles`` (the padding is dropped)."""
        if tiled.numel() != self.padded_numel:
            raise ValueError(f"expected {self.padded_numel} tile-major values, got {tiled.numel()}")
        out = tiled.new_empty(self.numel)
        out[self._from.to(tiled.device)] = tiled[self._targets.to(tiled.device)]
        return out


def fragment_layouts(shapes: Sequence[Sequence[Sequence[int]]], tile: int, chunk: int, *,
                     sharded: bool) -> list[TileLayout]:
    """SparseLoCo's layout of each fragment (``shapes``: its tensors'), for a codec whose chunks
    hold ``chunk`` values; ValueError where the tiles cannot be its chunks (a sharded model)."""
    if sharded:
        raise ValueError("SparseLoCo's tiles need each group's whole tensors; with a sharded model use "
                         "sparseloco(tile=None) (top-k over chunks of each rank's flat shards)")
    if chunk != tile * tile:
        raise ValueError(f"SparseLoCo's {tile}x{tile} tiles need the codec's chunk to be {tile * tile} values, "
                         f"not {chunk} (--codec-block {tile * tile})")
    return [TileLayout(s, tile) for s in shapes]


class FromTiles:
    """A pending mean exchanged in tile-major order: ``wait`` gives it back in the flat order;
    ``own_rejected`` is the wrapped pending result's."""

    def __init__(self, pending, layout: TileLayout) -> None:
        self._pending, self._layout = pending, layout
        self._value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._layout.from_tiles(self._pending.wait())
        return self._value

    @property
    def own_rejected(self) -> bool:
        """The quorum refused this group's contribution (``averaging.Refusable``)."""
        return refused(self._pending)
