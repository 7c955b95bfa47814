"""The sync modes as strategies: what a fragment's launch and the landing of its exchange do.

Every mode shares the engine's skeleton (``DiLoCo.step``: land what is due, then sync the fragments
that are due; a sync is ``before_launch``, the launch, ``after_launch``); a mode fills in the steps:

* ``blocking`` / ``overlap`` (``Overlap``): the exchange lands τ inner steps after its launch
  (``overlap_steps``; blocking: τ = 0, at the launch itself) and its mean is the outer step;
* ``delayed`` / ``co2`` (``Delayed``): a launch first applies the previous round's mean, one round
  stale (CO2 differs only by its outer rule, ``diloco.engine.outer.co2``);
* ``eager`` (``Eager``): a launch applies this group's fresh Δ and the others' previous-round Δ,
  ``(Δ_own(t) + M·mean(t−H) − Δ_own(t−H)) / M`` (with a weighted quorum: ``mean(t−H) + s·(Δ_own(t) −
  Δ_own(t−H))``, s = this group's share of that mean); ``close()`` reconciles the global copies.

A new mode is a ``SyncMode`` subclass named in ``MODE_CLASSES`` and its traits (what it allows, its
defaults) in ``diloco.engine.modes.MODE_TRAITS``. The engine side a mode drives is ``Host``: the few
operations it combines.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from diloco.engine.averaging import Averager, final_attempt, refused, share_of
from diloco.engine.events import SyncEvent
from diloco.engine.fragment import Fragment, InFlight
from diloco.engine.modes import MODE_TRAITS, MODES, ModeTraits, in_words, modes_where


class Host(Protocol):
    """What a sync mode uses of its engine (``DiLoCo``)."""

    inner_step: int
    averager: Averager

    def _delta(self, frag: Fragment) -> torch.Tensor:
        """The fragment's Δ to send (checked finite)."""
        ...

    def _land(self, frag: Fragment) -> tuple[torch.Tensor, InFlight]:
        """Wait for the fragment's exchange in flight; its mean, and what was in flight (a refused
        contribution has reset the fragment's local state)."""
        ...

    def _apply(self, frag: Fragment, update: torch.Tensor | None, round: int, attempt: int | None = None) -> SyncEvent:
        """Outer step on ``update`` (None: none), merge into the model; the commit event.
        ``attempt``: the attempt of the exchange whose final ranges were already stepped."""
        ...

    def _reset_local(self, frag: Fragment) -> None:
        """The fragment's local state restarts from the global copy (a refused contribution)."""
        ...

    def _event(self, frag: Fragment, round: int, kind: str, **extra: Any) -> SyncEvent: ...

    def _norm(self, flat: torch.Tensor) -> float: ...

    def _shards(self, frag: Fragment) -> dict[str, Any]: ...


class SyncMode:
    """A mode's steps, for one engine (``host``); ``tau``: τ, the inner steps between a launch
    and its landing; ``traits``: what the mode allows (``MODE_TRAITS``)."""

    def __init__(self, host: Host, tau: int, traits: ModeTraits) -> None:
        self.host, self.tau, self.traits = host, tau, traits

    def due(self, frag: Fragment) -> list[SyncEvent]:
        """At each inner step, before any launch: land what is due."""
        return []

    def before_launch(self, frag: Fragment) -> tuple[list[SyncEvent], torch.Tensor]:
        """A sync's first part: what it commits, and the Δ it then sends."""
        raise NotImplementedError

    def after_launch(self, frag: Fragment) -> list[SyncEvent]:
        """What a sync commits after its launch."""
        return []

    def close(self, frag: Fragment) -> list[SyncEvent]:
        """``close()``: land the fragment's exchange in flight."""
        raise NotImplementedError

    def finish(self, fragments: list[Fragment]) -> None:
        """``close()``, after every fragment landed."""

    def adopt(self, frag: Fragment) -> None:
        """A healer joins the fragment's exchange with a loaded state."""


class Overlap(SyncMode):
    """``overlap`` (Streaming DiLoCo): the exchange lands τ inner steps after its launch, its mean
    the outer step, merged with α."""

    def commit(self, frag: Fragment) -> SyncEvent:
        mean, flight = self.host._land(frag)
        event = self.host._apply(frag, mean, flight.round, final_attempt(flight.pending))
        if refused(flight.pending):
            self.host._reset_local(frag)
        return event

    def due(self, frag: Fragment) -> list[SyncEvent]:
        flight = frag.in_flight
        return [self.commit(frag)] if flight is not None and self.host.inner_step >= flight.apply_at else []

    def before_launch(self, frag: Fragment) -> tuple[list[SyncEvent], torch.Tensor]:
        events = [self.commit(frag)] if frag.in_flight is not None else []  # only if H shrank below τ
        return events, self.host._delta(frag)

    def after_launch(self, frag: Fragment) -> list[SyncEvent]:
        return [self.commit(frag)] if self.tau == 0 else []

    def close(self, frag: Fragment) -> list[SyncEvent]:
        return [self.commit(frag)]


class Blocking(Overlap):
    """``blocking`` (DiLoCo): the exchange lands at its launch (τ = 0)."""


class Delayed(SyncMode):
    """``delayed`` and ``co2``: a launch applies the previous round's mean, one round stale."""

    def before_launch(self, frag: Fragment) -> tuple[list[SyncEvent], torch.Tensor]:
        delta = self.host._delta(frag)
        update = self.update(frag, delta)
        return [self.host._apply(frag, update, frag.round)], delta

    def update(self, frag: Fragment, delta: torch.Tensor) -> torch.Tensor | None:
        """The outer step's pseudo-gradient at this launch (None: no step)."""
        return None if frag.in_flight is None else self.host._land(frag)[0]

    def close(self, frag: Fragment) -> list[SyncEvent]:
        mean, flight = self.host._land(frag)
        frag.outer_step(mean)
        return [self.host._event(frag, flight.round, "commit", delta_norm=self.host._norm(mean))]


class Eager(Delayed):
    """``eager`` (Kale et al. 2025): this group's fresh Δ with the others' previous-round Δ."""

    def update(self, frag: Fragment, delta: torch.Tensor) -> torch.Tensor:
        m = self.host.averager.num_groups
        if frag.in_flight is None:  # round 0: nothing from the others yet
            update = delta / m
        else:
            mean, flight = self.host._land(frag)
            # this group's part of that mean: w_own / sum(w) of the quorum that committed it
            # (0 if it was refused or healing in); averagers without quorums: 1/M
            share = share_of(flight.pending)
            if share is None:
                update = (delta + (m * mean - frag.own_previous)) / m
            elif share == 0:  # refused or healing: the mean holds nothing of ours to replace
                update = mean.clone()
            else:
                update = mean + share * (delta - frag.own_previous)
        frag.own_previous = delta
        return update

    def close(self, frag: Fragment) -> list[SyncEvent]:
        self.host._land(frag)  # its own share of it was used at the last launch
        return []

    def finish(self, fragments: list[Fragment]) -> None:
        """Reconcile: every group adopts the mean of the groups' global copies (exact fp32)."""
        for frag in fragments:
            mean = self.host.averager.start(frag.flat_global(), tag=f"f{frag.index}/final", exact=True,
                                            **self.host._shards(frag)).wait()
            frag.load_flat_global(mean)

    def adopt(self, frag: Fragment) -> None:
        frag.own_previous = torch.zeros_like(frag.flat_global())


MODE_CLASSES: dict[str, type[SyncMode]] = {
    "blocking": Blocking, "overlap": Overlap, "eager": Eager, "delayed": Delayed, "co2": Delayed,
}
assert tuple(MODE_CLASSES) == MODES, "every mode of MODE_TRAITS has its class here, in the same order"


def choose(mode: str, overlap_steps: int | None, merge_alpha: float | None, *,
           error_feedback: bool) -> tuple[type[SyncMode], ModeTraits, int, float]:
    """The class of ``mode``, its traits, its τ and its merge α (the mode's defaults for None),
    checked against each other and against an averager whose codec needs ``error_feedback``."""
    if mode not in MODE_CLASSES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    traits = MODE_TRAITS[mode]
    if error_feedback and not traits.error_feedback:
        raise ValueError(f"mode {mode!r} cannot use a codec that needs error feedback (int2, sign1, topk): its "
                         "own-share correction assumes the mean holds this group's exact Δ")
    alpha = traits.default_alpha if merge_alpha is None else merge_alpha
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"merge_alpha must be in [0, 1], got {alpha}")
    tau = traits.default_tau if overlap_steps is None else overlap_steps
    if tau < 0:
        raise ValueError(f"overlap_steps must be >= 0, got {overlap_steps}")
    if tau and not traits.takes_tau:
        raise ValueError(f"overlap_steps applies to mode {in_words(modes_where('takes_tau'))} only, not {mode!r}")
    return MODE_CLASSES[mode], traits, tau, alpha
