"""One fragment of the model as the engine syncs it (torchft's ``_StreamingDiLoCoFragment``, shaped
for this engine): its outer state (the fp32 global copy and its outer optimizer, ``OuterFragment``),
its round count and step clock (when it syncs next, when it last launched), the exchange it has in
flight, and, in mode ``eager``, this group's Δ of its previous round. ``DiLoCo`` holds one per
fragment; its sync mode (``diloco.engine.sync_modes``) decides what a launch and a landing do.

Which parameters a fragment holds is decided before (``fragment_names``; the rules of a split are
``diloco.engine.fragments.partition``). The error-feedback residuals are the group's
``diloco.engine.error_feedback.Residuals``, indexed by fragment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from compress.finite import all_finite
from diloco.engine.averaging import Done, PendingMean
from diloco.engine.events import NonFiniteError
from diloco.engine.modes import MAX_FRAGMENTS
from diloco.engine.outer import OuterOptimizerFactory
from diloco.engine.outer_state import OuterFragment

NEVER = 2**62  # next_sync of a time round: it ends by the clock, not at a step


@dataclass
class InFlight:
    """A fragment's exchange that was launched and has not landed yet."""

    pending: PendingMean
    round: int
    apply_at: int  # inner step at which an ``overlap`` exchange is merged


class Fragment(OuterFragment):
    """Fragment ``index`` of an engine: ``OuterFragment``'s outer state of ``local_params`` plus
    the state of its syncs (see the module doc)."""

    def __init__(self, index: int, names: Sequence[str], local_params: Sequence[torch.Tensor], *,
                 outer_optimizer: OuterOptimizerFactory, device: torch.device | None) -> None:
        super().__init__(names, local_params, outer_optimizer=outer_optimizer, device=device)
        self.index = index
        self.round = 0  # exchanges launched so far: the id of the next one
        self.next_sync = NEVER  # inner step at which it syncs next
        self.launched_at = 0  # inner step of its last launch
        self.in_flight: InFlight | None = None
        self.own_previous: torch.Tensor | None = None  # eager: this group's Δ of the previous round
        self._delta: torch.Tensor | None = None  # the vector launches write their Δ into (``_delta_buffer``)
        self._mean: torch.Tensor | None = None  # the vector an averager writes the mean into (``mean_buffer``)

    @property
    def tag(self) -> str:
        """The name of its next exchange (``f<index>/r<round>``), the same on every group."""
        return f"f{self.index}/r{self.round}"

    def delta(self, inner_step: int, *, screened: bool) -> torch.Tensor:
        """Δ = θ_global − θ_local (flat fp32). ``NonFiniteError`` if it holds NaN/Inf, unless the
        averager screens contributions (``screened``: the quorum refuses it instead)."""
        delta = self.pseudo_gradient(out=self._delta_buffer())
        if not screened and not all_finite(delta):
            raise NonFiniteError(
                f"fragment {self.index} round {self.round}: local pseudo-gradient has NaN/Inf at inner "
                f"step {inner_step}; nothing was sent or applied"
            )
        return delta

    @property
    def _keeps_vectors(self) -> bool:
        """Whether the global copy lives in host memory, where a fresh vector costs page faults."""
        return not self.staged and self.global_params[0].device.type == "cpu"

    def _delta_buffer(self) -> torch.Tensor | None:
        """Where this launch's Δ is written: a vector kept for the fragment's life in host memory
        (a fresh one per round costs a page fault per 4 KiB: at 19M parameters 39 ms against 11 ms
        into a kept one here, bench/fresh_vectors.py; a GPU's caching allocator has no such cost), reused while
        nothing still reads the previous round's Δ: no exchange of this fragment in flight (a
        blocking or overlap launch lands it first; delayed and eager land it after) and not eager's
        own share. None: a fresh vector."""
        if not self._keeps_vectors:
            return None
        if self.in_flight is not None or (self._delta is not None and self.own_previous is self._delta):
            self._delta = None  # delayed, eager: a fresh Δ each round; the kept one goes with its exchange
            return None
        if self._delta is None:
            self._delta = torch.empty(self.local_numel, dtype=torch.float32)
        return self._delta

    def mean_buffer(self) -> torch.Tensor | None:
        """Where this launch's exchange may write its mean (``averaging.WritesInto``): a vector
        kept in host memory from round to round while the exchanges return their mean in it (a
        launch comes after the previous mean was used: every mode lands and steps it first).
        None (the averager's own vector) for a global copy elsewhere."""
        if not self._keeps_vectors:
            return None
        if self._mean is None:
            self._mean = torch.empty(self.local_numel, dtype=torch.float32)
        return self._mean

    def launched(self, pending: PendingMean, inner_step: int, apply_at: int) -> int:
        """Its exchange ``pending`` started at ``inner_step``: now in flight, to land at ``apply_at``.
        Returns the inner steps since its previous launch."""
        self.in_flight = InFlight(pending, self.round, apply_at)
        self.round += 1
        steps, self.launched_at = inner_step - self.launched_at, inner_step
        return steps

    def land(self) -> tuple[torch.Tensor, InFlight]:
        """Wait for the exchange in flight; returns its mean and what was in flight. Raises
        ``NonFiniteError`` (nothing applied) if the mean holds NaN/Inf."""
        flight = self.in_flight
        assert flight is not None, f"fragment {self.index} has no exchange in flight"
        mean = flight.pending.wait()
        self.in_flight = None
        if mean is not self._mean:  # a retry's own vector: an abandoned attempt may still write ours
            self._mean = None
        if not all_finite(mean):
            raise NonFiniteError(f"fragment {self.index} round {flight.round}: averaged pseudo-gradient has NaN/Inf; "
                                 "not applied")
        return mean, flight

    def sync_state(self) -> dict:
        """Its sync state for a checkpoint: the exchange in flight is waited for (its value does
        not depend on when it is read) and stored as its result."""
        flight, landed = self.in_flight, None
        if flight is not None:
            done = Done.of(flight.pending)  # whether its quorum refused this group, its share, its attempt
            flight.pending = done
            landed = {"mean": done.value.detach().clone(), "round": flight.round, "apply_at": flight.apply_at,
                      **done.facts()}
        own = self.own_previous
        return {"names": list(self.names), "round": self.round, "next_sync": self.next_sync,
                "launched_at": self.launched_at, "in_flight": landed,
                "own_previous": None if own is None else own.detach().clone()}

    def load_sync_state(self, saved: dict) -> None:
        """Restore what ``sync_state`` saved (tensors go to the global copy's device)."""
        device = self.global_params[0].device
        self.round = int(saved["round"])
        self.next_sync = int(saved["next_sync"])
        self.launched_at = int(saved.get("launched_at", 0))
        self._delta = self._mean = None  # an exchange replaced here unwaited may still read or write them
        landed = saved["in_flight"]
        self.in_flight = None if landed is None else InFlight(
            Done(landed["mean"].to(device), own_rejected=bool(landed.get("own_rejected", False)),
                 own_share=_optional(landed.get("own_share"), float),
                 final_attempt=_optional(landed.get("final_attempt"), int)),
            int(landed["round"]), int(landed["apply_at"]))
        own = saved["own_previous"]
        self.own_previous = None if own is None else own.to(device)


def _optional(value: object, kind: type) -> object:
    return None if value is None else kind(value)


def fragment_names(model: nn.Module, named: dict[str, torch.Tensor],
                   fragments: int | Sequence[Sequence[str]] | None) -> list[list[str]]:
    """The parameter names of each fragment: every trainable one (``named``) for None, ``partition``'s
    split for a count, or the lists given, which must cover every trainable parameter once."""
    if fragments is None:
        groups = [list(named)]
    elif isinstance(fragments, int):
        from diloco.engine.fragments import partition

        groups = partition(model, fragments)
    else:
        groups = [list(f) for f in fragments]
        seen = [n for f in groups for n in f]
        if sorted(seen) != sorted(named) or len(seen) != len(set(seen)):
            raise ValueError("fragments must cover every trainable parameter exactly once")
    if len(groups) > MAX_FRAGMENTS:
        raise ValueError(f"{len(groups)} fragments: at most {MAX_FRAGMENTS} (each keeps an exchange in flight, and "
                         "the coordinator refuses exchanges asked too far ahead of the job)")
    return groups


def first_syncs(num_fragments: int, h: int) -> list[int]:
    """Inner-step count of each fragment's first sync: ``(p+1)·H/P`` (floor), staggered."""
    if h < num_fragments:
        raise ValueError(f"H ({h}) must be >= the number of fragments ({num_fragments})")
    return [((p + 1) * h) // num_fragments for p in range(num_fragments)]
