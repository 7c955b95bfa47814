"""Error feedback across groups: each group's residual of what its compressed Δ did not deliver.

With a biased codec (``sign1``, ``topk``) every group keeps, per fragment, a residual ``e`` (fp32,
the fragment's length, on the global copy's device) and sends ``y = Δ + e`` instead of Δ::

    y = Δ + β·e;   send C(y);   e ← y − decode(C(y))      (β = 1, or --residual-decay; SparseLoCo's rule: 0.95)

so over any number of rounds everything the other groups decoded of this group, plus ``e``, is
the sum of its Δs: nothing a round drops is lost, it is sent later (docs/algorithms.md §8.2). The
averager must carry each group's own encoded ``y`` to every group (``all_gather_mean``, not the
ring all-reduce, which re-encodes partial sums) and say what they decoded of it: its pending
result's ``sent``.

The residual changes only when an exchange lands (``wait`` returned the committed mean), from that
exchange's ``sent``: an attempt that was rolled back and retried never touches it, and an
exchange that refused this group's contribution (``own_rejected``: NaN/Inf or an outlier, the
engine then resets the fragment's local state) leaves it as it was. Every rank of a group holds
the whole residual, the same bits on every rank (the averager shares each rank's stripes of
``sent`` in the group), so a new stripe plan (other bandwidths, another quorum) needs no transfer
and every rank's checkpoint holds the group's residual. A group that heals into a running job
starts with a zero residual: the donor's is the donor's own, which the donor still sends.

``Feedback`` is a group's error feedback over its fragments as the engine runs it: the residuals
kept while the codec needs them, owed once when it stops (``--codec auto``, ``--final-codec``), and
SparseLoCo's tile-major layouts (``diloco.engine.tiles``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from diloco.engine.averaging import PendingMean, decoded, refused
from diloco.engine.tiles import FromTiles, TileLayout, fragment_layouts


class Residuals:
    """The error-feedback residual of each of ``num_fragments`` fragments of one group.
    ``decay``: β of SparseLoCo, ``y = Δ + β·e`` (1: plain error feedback)."""

    def __init__(self, num_fragments: int, decay: float = 1.0) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"the residual's decay must be in [0, 1], got {decay}")
        self.residual: list[torch.Tensor | None] = [None] * num_fragments  # None: zero
        self.decay = decay

    def start(self, averager: Any, p: int, delta: torch.Tensor, *, tag: str, **kwargs: Any) -> "Landing":
        """Launch fragment p's exchange of ``delta + decay * residual`` (``delta`` is not changed);
        the residual is updated when the returned pending result is first waited for."""
        e = self.residual[p]
        y = delta.detach().to(torch.float32).clone() if e is None else delta.detach().to(torch.float32) + (
            e if self.decay == 1.0 else self.decay * e)
        pending = averager.start(y, tag=tag, error_feedback=True, **kwargs)
        return Landing(self, p, y, pending)

    def land(self, p: int, y: torch.Tensor, sent: torch.Tensor) -> None:
        """Fragment p's exchange of ``y`` landed and the others decoded ``sent`` of it:
        ``e ← y − sent`` (``y`` becomes the residual)."""
        if sent is None or sent.shape != y.shape:
            raise RuntimeError(f"fragment {p}: the averager did not say what the other groups decoded of this "
                               "group's contribution (no error feedback without it)")
        self.residual[p] = y.sub_(sent.to(y.device))

    def state_of(self, p: int) -> torch.Tensor | None:
        """Fragment p's residual (a copy; None: zero), for a checkpoint."""
        e = self.residual[p]
        return None if e is None else e.detach().clone()

    def load(self, p: int, saved: torch.Tensor | None, numel: int, device: torch.device | str) -> None:
        """Restore fragment p's residual (None: zero): ``numel`` fp32 values, put on ``device``."""
        if saved is None:
            self.residual[p] = None
            return
        if not isinstance(saved, torch.Tensor) or saved.dtype != torch.float32 or saved.dim() != 1 \
                or saved.numel() != numel:
            raise ValueError(f"fragment {p}: residual of {getattr(saved, 'dtype', type(saved))} "
                             f"{tuple(getattr(saved, 'shape', ()))}, want float32 ({numel},)")
        self.residual[p] = saved.detach().to(device).clone()

    def take(self, p: int) -> torch.Tensor | None:
        """Fragment p's residual, which it no longer keeps (None: zero), as the next exchange would
        have sent it (``decay · e``): error feedback stopped (``DiLoCo.set_error_feedback``) and
        the residual is sent once, in its next Δ."""
        e, self.residual[p] = self.residual[p], None
        return e if e is None or self.decay == 1.0 else self.decay * e

    def reset(self) -> None:
        """Forget every residual (a group healed from another group's state)."""
        self.residual = [None] * len(self.residual)


class Landing:
    """A pending exchange whose first ``wait`` also updates the fragment's residual."""

    def __init__(self, residuals: Residuals, p: int, y: torch.Tensor, pending: PendingMean) -> None:
        self._residuals, self._p, self._y, self._pending = residuals, p, y, pending
        self._landed = False

    @property
    def own_rejected(self) -> bool:
        """The quorum refused this group's contribution (it then sent zeros)."""
        return refused(self._pending)

    def wait(self) -> torch.Tensor:
        mean = self._pending.wait()
        if not self._landed:
            self._landed = True
            if not self.own_rejected:  # a refused Δ (NaN, outlier) must not enter the residual
                self._residuals.land(self._p, self._y, decoded(self._pending))
            self._y = None  # type: ignore[assignment]
        return mean


class Feedback:
    """A group's error feedback over its ``num_fragments`` fragments, as its codec asks: the
    residuals it keeps (``residuals``; None: its codec needs none), those it still owes once after
    its codec stopped needing them (``set(False)``), and SparseLoCo's tile-major layout of each
    fragment (``tiles``, or None), in which the residual and the codec see it."""

    def __init__(self, num_fragments: int, decay: float, *, on: bool, tiles: list[TileLayout] | None) -> None:
        self.num_fragments, self.decay, self.tiles = num_fragments, decay, tiles
        self.residuals = Residuals(num_fragments, decay) if on else None
        self._flushing: Residuals | None = None  # residuals still to send once

    @classmethod
    def for_rule(cls, rule: Any, residual_decay: float, *, on: bool, codec: Any,
                 shapes: Sequence[Sequence[Sequence[int]]], sharded: bool) -> "Feedback":
        """The error feedback of fragments of ``shapes`` (each its tensors') under outer rule
        ``rule``: SparseLoCo's (its ``error_decay`` and ``tile``) needs ``on`` (a codec with error
        feedback, ``codec``) and sets the decay itself; any other keeps ``residual_decay``."""
        decay = getattr(rule, "error_decay", None)  # SparseLoCo's β
        if decay is not None and not on:
            raise ValueError(f"{rule!r} needs an averager with error feedback: a codec that needs one (--codec topk, int2 "
                             "or sign1), whose residual stands in for outer momentum")
        if not 0.0 <= residual_decay <= 1.0:
            raise ValueError(f"residual_decay must be in [0, 1], got {residual_decay}")
        if decay is not None and residual_decay != 1.0:
            raise ValueError(f"{rule!r} sets the residual's decay itself (its beta): no residual_decay with it")
        tile = getattr(rule, "tile", None) if decay is not None else None
        tiles = None if tile is None else fragment_layouts(shapes, tile, getattr(codec, "chunk", tile * tile),
                                                           sharded=sharded)
        return cls(len(shapes), residual_decay if decay is None else decay, on=on, tiles=tiles)

    def set(self, on: bool) -> None:
        """Keep a residual per fragment from the next launch on (each starts at zero), or stop
        keeping them: each fragment then adds its residual once to its next Δ."""
        if on == (self.residuals is not None):
            return
        if on:  # residuals not yet flushed are still owed: keep them
            self.residuals, self._flushing = self._flushing or Residuals(self.num_fragments, self.decay), None
            return
        if self.tiles is not None:
            raise ValueError("SparseLoCo's outer rule needs error feedback: its codec must keep one")
        self._flushing, self.residuals = self.residuals, None

    def start(self, averager: Any, p: int, delta: torch.Tensor, *, tag: str, **kwargs: Any) -> PendingMean:
        """Launch fragment p's exchange of ``delta`` with what its error feedback adds (``kwargs``
        go to ``averager.start``); the mean comes back in the fragment's own order."""
        owed = self._flushing.take(p) if self._flushing is not None else None
        if owed is not None:  # error feedback stopped; this fragment's last exchange with it has landed
            delta = delta + owed.to(delta.device)
        if self.residuals is None:
            return averager.start(delta, tag=tag, **kwargs)
        if self.tiles is None:  # sends Δ + residual; the residual moves when it lands
            return self.residuals.start(averager, p, delta, tag=tag, **kwargs)
        layout = self.tiles[p]  # residual and codec in tile-major order, the mean back in place
        kwargs.pop("out", None)  # the caller's vector is in its own order: the tiles' mean comes in one of its own
        return FromTiles(self.residuals.start(averager, p, layout.to_tiles(delta), tag=tag, **kwargs), layout)

    def joined(self, p: int, pending: PendingMean) -> PendingMean:
        """Fragment p's part in an exchange it joined (healing), in the fragment's own order."""
        return pending if self.tiles is None else FromTiles(pending, self.tiles[p])

    def state_of(self, p: int) -> torch.Tensor | None:
        """Fragment p's residual for a checkpoint (None: zero, or none kept)."""
        return None if self.residuals is None else self.residuals.state_of(p)

    def load(self, p: int, saved: torch.Tensor | None, numel: int, device: torch.device | str) -> None:
        """Restore fragment p's residual (where one is kept; ``numel``: the fragment's, before tiling)."""
        if self.residuals is not None:  # absent (None) in states saved without error feedback
            self.residuals.load(p, saved, numel if self.tiles is None else self.tiles[p].padded_numel, device)
