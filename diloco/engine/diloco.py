"""The DiLoCo engine: local inner steps, then outer steps on averaged pseudo-gradients.

One class, ``DiLoCo``, for every sync policy. Each rank of each group runs the same code::

    with DiLoCo(model, inner_opt, sync_every=30, averager=averager, hook_optimizer=True):
        for batch in data:                       # the loop keeps its shape: the engine runs
            loss(model, batch).backward()        # after every inner_opt.step()
            inner_opt.step(); inner_opt.zero_grad()

(or ``hook_optimizer=False`` and ``engine.step()`` after each inner step). Leaving the ``with``
block (or ``close()``) lands every exchange in flight; the model then holds the global parameters.

Semantics (docs/algorithms.md §0.1, §1.1, §3.3, §4, §5, §12), with ``Δ = θ_global − θ_local`` in
fp32 (a descent direction, like a gradient):

* the parameters are split into P fragments (``fragments``, one by default). Fragment p first
  syncs after ``(p+1)·H/P`` inner steps, then every H (H from the schedule, recomputed from the
  current inner lr after each of its syncs, so QSR works per fragment);
* each fragment (``diloco.engine.fragment.Fragment``) owns its outer state and its syncs' state;
  the sync mode (``diloco.engine.sync_modes``) decides what its launch and its landing do:
  ``blocking`` (average Δ_p, outer step, merge), ``overlap`` (Streaming DiLoCo: land τ =
  ``overlap_steps`` inner steps later), ``eager`` (Kale et al. 2025: this group's fresh Δ with the
  others' previous-round Δ; global copies differ slightly until ``close()``), ``delayed`` (the
  previous round's mean) and ``co2`` (Sun et al. 2024: ``delayed`` with ``outer.co2``);
* the merge is ``θ_local ← α·θ_local + (1−α)·θ_global`` (α = ``merge_alpha``; 0 adopts θ_global);
* the inner optimizer's state is never touched: it stays local to the group.

At construction every group's initial parameters are made equal (``initial_sync="copy"``: group
0's are copied over the data plane) or verified equal by hash (``"check"``, the default: a
mismatch raises ``InitialParamsMismatch`` on every group).

A model sharded inside the group with FSDP2 (``fully_shard``: its parameters are DTensors) works
the same way on each rank's shard (``diloco.engine.sharded``): the global copy, the outer state
and every pseudo-gradient cover only what the rank holds, and each rank exchanges its shard with
the ranks of the other groups that hold the same elements (the averager's ``shards=``).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from diloco.engine.averaging import Averager, Capabilities, Coded, Healing, Observing, PendingMean, refused
from diloco.engine.error_feedback import Feedback, Residuals
from diloco.engine.events import NonFiniteError, SyncEvent
from diloco.engine.final_codec import FinalCodec
from diloco.engine.fragment import NEVER, Fragment, first_syncs, fragment_names
from diloco.engine.fragment_views import FragmentViews
from diloco.engine.initial import agree
from diloco.engine.modes import MODES, InitialSync, Mode, in_words, modes_where
from diloco.engine.outer import OuterOptimizerFactory, by_mode
from diloco.engine.round_clock import RoundClock, RoundTiming
from diloco.engine.schedule import FixedSchedule, SyncSchedule, TimeRounds
from diloco.engine.sharded import ShardedState
from diloco.engine.sync_modes import choose
from diloco.engine.tiles import TileLayout

__all__ = ["DiLoCo", "MODES", "NEVER", "NonFiniteError", "STATE_VERSION", "SyncEvent", "SyncResult", "first_syncs"]

STATE_VERSION = 1


class DiLoCo(FragmentViews, RoundTiming):
    """Wraps a model and its inner optimizer; syncs with the other groups on a schedule.

    ``sync_every``: H (inner steps) or a ``SyncSchedule``. ``mode``: one of ``MODES``.
    ``fragments``: None (one), a count P (``diloco.engine.fragments.partition``), or name lists.
    ``overlap_steps``: τ for ``overlap`` (default 1). ``merge_alpha``: α (default 0.5 for
    ``overlap``, 0 otherwise). ``outer_optimizer``: a factory (default
    ``diloco.engine.outer.by_mode(mode)``: Nesterov 0.7/0.9, eager 0.7/0.5, delayed 0.7/0, co2 ``co2()``).
    ``averager``: how Δ is averaged across groups — required: ``diloco.connect(...)``
    for real groups, ``diloco.SingleGroup()`` to train one group alone. ``global_device``:
    ``"model"`` or a device for the fp32 global copy. ``hook_optimizer``: run ``step()`` after
    every ``inner_optimizer.step()``. ``initial_sync``: ``"check"`` or ``"copy"`` (see module doc).

    Rounds by time (``sync_every=TimeRounds(seconds, rounds)``; modes ``blocking`` and
    ``overlap``, any fragments): a fragment's round ends after the step that ``round_over`` picks
    for its deadline on ``clock`` (seconds; ``time.monotonic``), and each contribution weighs its
    inner steps. The deadline is ``seconds`` after the round began: in ``blocking`` after the
    previous commit (every group commits together), in ``overlap`` where the previous round was
    due (no barrier: a fixed grid from the engine's start, so a slow group's late fragment holds
    nobody). With P fragments, fragment p's first round ends ``(p + 1) / P`` of ``seconds`` in,
    as ``first_syncs`` staggers H. A group of several ranks passes ``round_vote``, which every
    rank calls at every step with its own verdict (a bit mask of the fragments whose round ends)
    and which returns one verdict for all (rank 0's, broadcast), so every rank ends a round on
    the same step.

    ``final_codec``: a codec for each fragment's last exchange (launched at the schedule's last
    step, or in the last time round) in place of the averager's. With an error-fed codec before
    it, the residuals go out with that exchange (``set_error_feedback``), so the final model holds
    what the groups computed and the 2-bit/1-bit codecs held back. Needs an averager that switches
    codecs (``set_codec``) and a schedule that knows its end.

    ``residual_decay``: β of the error feedback of a codec that keeps one (int2, sign1, topk):
    each exchange sends ``Δ + β·e``. 1 (the default) keeps every error until it is sent; 0 drops
    each exchange's error (the codec then runs biased, without feedback). SparseLoCo's rule sets
    its own (``sparseloco(beta=...)``).
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        averager: Averager,
        sync_every: int | SyncSchedule = 500,
        mode: Mode = "blocking",
        fragments: int | Sequence[Sequence[str]] | None = None,
        overlap_steps: int | None = None,
        merge_alpha: float | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
        global_device: str | torch.device = "model",
        hook_optimizer: bool = False,
        initial_sync: InitialSync = "check",
        clock: Callable[[], float] = time.monotonic,
        round_vote: Callable[[int], int] | None = None,
        final_codec: Any = None,
        residual_decay: float = 1.0,
    ) -> None:
        can = Capabilities.of(averager)
        sync_mode, traits, self.overlap_steps, self.merge_alpha = choose(mode, overlap_steps, merge_alpha,
                                                                         error_feedback=can.error_feedback)
        if averager is None:
            raise ValueError("averager is required: diloco.connect(...) for groups, diloco.SingleGroup() for one")
        self.model, self.inner_optimizer, self.averager, self.mode = model, inner_optimizer, averager, mode
        self.schedule: SyncSchedule = FixedSchedule(sync_every) if isinstance(sync_every, int) else sync_every
        bind = getattr(self.schedule, "bind", None)  # a schedule that acts on its engine (--codec auto's switches)
        if bind is not None:
            bind(self)
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not named:
            raise ValueError("the model has no trainable parameters")
        groups = fragment_names(model, named, fragments)
        self.time_rounds = self.schedule if isinstance(self.schedule, TimeRounds) else None
        if self.time_rounds is not None and not traits.time_rounds:
            raise ValueError(f"rounds by time run with mode {in_words(modes_where('time_rounds'))}, not {mode!r}")
        self.clock = clock
        device = None if str(global_device) == "model" else torch.device(global_device)
        rule = outer_optimizer or by_mode(mode)
        self.fragments = [Fragment(p, f, [named[n] for n in f], outer_optimizer=rule, device=device)
                          for p, f in enumerate(groups)]
        #: a model sharded in the group (FSDP2): per-fragment layouts and the group's collectives
        self.sharded = ShardedState.of(self.fragments, averager)
        at = 0
        for frag in self.fragments:  # the state hash runs over the fragments' global copies in order
            frag.place_in_hash(at, fold=self.sharded is None)
            at += frag.local_numel
        healing = isinstance(averager, Healing) and bool(averager.attach(self))  # a late group heals instead
        if not healing:  # every group starts from the same parameters
            (self.sharded.agree if self.sharded is not None else agree)(averager, self.global_params, initial_sync)
        for frag in self.fragments:
            frag.merge_into_model(0.0)
        self._changed()
        #: rounds by time, a healer's catch-up (``diloco.engine.round_clock``); made after the initial
        #: exchange, which every group leaves together: rounds by time count from there on every group
        self.round_clock = RoundClock(len(groups), self.time_rounds, overlap=traits.round_grid, clock=clock,
                                      vote=round_vote)
        self.inner_step = 0
        if self.time_rounds is None:
            for frag, at in zip(self.fragments, first_syncs(len(groups), self.schedule.period(0, self.current_lr()))):
                frag.next_sync = at
        self._skipping = False
        self.round_steps: list[int] = []  # time rounds: the inner steps this group trained in each round of fragment 0
        self._round_steps = 0  # inner steps of the round launched last
        if self.time_rounds is None and self.overlap_steps and self.overlap_steps >= min(self.next_sync):
            raise ValueError(f"overlap_steps ({self.overlap_steps}) must be < H/P ({min(self.next_sync)}): "
                             "a fragment's exchange must land before the next fragment is due")
        #: the sync mode's steps (``diloco.engine.sync_modes``)
        self.sync = sync_mode(self, self.overlap_steps, traits)
        self._weighted, self._screened = can.weighted, can.screens_contributions
        self._streams = can.streams_final  # the outer step runs range by range as the mean arrives
        self._writes_into = can.writes_into  # the mean comes back in the fragment's own vector
        self._observer = averager if isinstance(averager, Observing) else None
        #: sign1/topk: each fragment's residual of what this group's exchanges have not delivered yet
        self.feedback = Feedback.for_rule(rule, residual_decay, on=can.error_feedback,
                                          codec=averager.codec if isinstance(averager, Coded) else None,
                                          shapes=[[tuple(g.shape) for g in f.global_params] for f in self.fragments],
                                          sharded=self.sharded is not None)
        self.residual_decay = self.feedback.decay
        self.final_codec = final_codec
        self._final = None if final_codec is None else FinalCodec(self, final_codec)  # checked here
        self.finished = False
        self.sync_seconds = 0.0  # time spent inside step()/close() on syncs
        self.last_events: list[SyncEvent] = []
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step) if hook_optimizer else None
        if healing:
            averager.heal(self)

    # --- the training-loop API ----------------------------------------------------------------

    def current_lr(self) -> float:
        """The inner optimizer's lr now (first param group), the input of adaptive schedules."""
        return float(self.inner_optimizer.param_groups[0]["lr"])

    def step(self) -> list[SyncEvent]:
        """Count one inner step; land the exchanges that are due, launch the fragments that are
        due. Returns what happened (an empty list on most steps)."""
        if self.finished:
            raise RuntimeError("step() after close()")
        t0 = time.perf_counter()
        self.inner_step += 1
        if self.round_clock.catch_up is not None:
            if self._skipping:
                self.round_clock.step_end = self.clock()
            else:
                self.round_clock.note_step()
        if self.time_rounds is not None:
            for p in self.round_clock.due(self.rounds):
                self.fragments[p].next_sync = self.inner_step
        events = [e for frag in self.fragments for e in self.sync.due(frag)]
        for frag in self.fragments:
            if self.inner_step >= frag.next_sync:
                events.extend(self._sync(frag))
        return self._done(events, t0)

    def _after_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step()

    def _done(self, events: list[SyncEvent], t0: float) -> list[SyncEvent]:
        if events:
            self.sync_seconds += time.perf_counter() - t0
        self.last_events = events
        if self._observer is not None:
            self._observer.observe(self, events)
        return events

    @torch.no_grad()
    def close(self) -> list[SyncEvent]:
        """Land every exchange in flight (eager: reconcile the groups' global copies), load the
        global parameters into the model, stop hooking the optimizer. Idempotent."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.finished:
            return []
        t0 = time.perf_counter()
        events = [e for frag in self.fragments if frag.in_flight is not None for e in self.sync.close(frag)]
        self.sync.finish(self.fragments)
        for frag in self.fragments:
            frag.merge_into_model(0.0)
        self.finished = True
        self._changed()
        return self._done(events, t0)

    finish = close

    def abandon(self) -> None:
        """Stop without waiting for exchanges in flight (after an error: peers may be gone)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for frag in self.fragments:
            frag.in_flight = None
            if frag.streamed is not None:
                frag.streamed.stop()
        self.finished = True

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    # --- what a sync mode combines (``sync_modes.Host``) ----------------------------------------

    def _event(self, frag: Fragment, round: int, kind: str, **extra: Any) -> SyncEvent:
        return SyncEvent(frag.index, round, kind, self.inner_step, frag.numel, **extra)  # type: ignore[arg-type]

    def _shards(self, frag: Fragment) -> dict[str, Any]:
        """The averager's ``shards=`` argument for a fragment: its layout when sharded, else none."""
        return {} if self.sharded is None else {"shards": self.sharded.layouts[frag.index]}

    def _norm(self, flat: torch.Tensor) -> float:
        """L2 norm of a fragment's vector: of the whole fragment (every rank's shard) when sharded."""
        return float(flat.norm()) if self.sharded is None else self.sharded.norm(flat)

    def _changed(self) -> None:
        """The global parameters changed: ``global_hash()`` takes them again when next asked; a
        sharded engine hashes them now (a collective of the group, at the same point on every
        rank), so ``global_hash()`` never needs one."""
        self._global_hash = None
        if self.sharded is not None:
            self.sharded.rehash(self.fragments)

    def _delta(self, frag: Fragment) -> torch.Tensor:
        return frag.delta(self.inner_step, screened=self._screened)

    def _land(self, frag: Fragment) -> tuple[torch.Tensor, Any]:
        mean, flight = frag.land()
        if refused(flight.pending):
            self._reset_local(frag)
        return mean, flight

    def _apply(self, frag: Fragment, update: torch.Tensor | None, round: int, attempt: int | None = None) -> SyncEvent:
        if update is not None:
            frag.outer_step(update, attempt)
            self._changed()
        frag.merge_into_model(self.merge_alpha)
        return self._event(frag, round, "commit", delta_norm=None if update is None else self._norm(update))

    @torch.no_grad()
    def _reset_local(self, frag: Fragment) -> None:
        """The quorum refused this group's contribution (NaN/Inf or an outlier): its local state is
        not to be trusted, so the fragment's parameters restart from the global ones and their
        inner-optimizer state is dropped."""
        frag.merge_into_model(0.0)
        for param in frag.local_params:
            self.inner_optimizer.state.pop(param, None)

    # --- one fragment's sync ------------------------------------------------------------------

    @property
    def error_feedback(self) -> Residuals | None:
        """The residuals kept per fragment; None while the codec needs none."""
        return self.feedback.residuals

    @property
    def tiles(self) -> list[TileLayout] | None:
        """SparseLoCo: each fragment's tile-major layout (None: the flat order)."""
        return self.feedback.tiles

    def set_error_feedback(self, on: bool) -> None:
        """The averager switched codec between launches (``--codec auto`` following the link, on
        every group at the same launch): keep a residual per fragment from the next launch on
        (each starts at zero), or stop keeping them. A residual holds what earlier exchanges
        did not deliver yet, so when they stop each fragment adds its residual once to its next
        Δ, which the new codec sends; nothing is lost. SparseLoCo's rule needs its residuals."""
        self.feedback.set(on)

    def _sync(self, frag: Fragment) -> list[SyncEvent]:
        events, delta = self.sync.before_launch(frag)
        if self._final is not None:
            self._final.before_launch(frag)
        events.append(self._launch(frag, delta))
        return self._after_launch(frag, events)

    def _launch(self, frag: Fragment, delta: torch.Tensor) -> SyncEvent:
        extra = {"weight": float(self.inner_step - frag.launched_at)} if self._weighted else {}
        extra.update(self._shards(frag))
        if self._writes_into and self.sharded is None:
            extra["out"] = frag.mean_buffer()
        if frag.streamed is not None:
            frag.streamed.begin()
            if self._streams and self.sync.traits.streams and frag.feeds_ranges and self.feedback.residuals is None \
                    and self.sharded is None:
                extra["on_final"] = frag.streamed.on_final
        return self._launched(frag, self.feedback.start(self.averager, frag.index, delta, tag=frag.tag, **extra))

    def _launched(self, frag: Fragment, pending: PendingMean) -> SyncEvent:
        r = frag.round
        self._round_steps = frag.launched(pending, self.inner_step, self.inner_step + self.sync.tau)
        return self._event(frag, r, "launch")

    def _after_launch(self, frag: Fragment, events: list[SyncEvent]) -> list[SyncEvent]:
        events.extend(self.sync.after_launch(frag))
        self.round_clock.launched(frag.index)
        if self.time_rounds is not None:
            period, frag.next_sync = 0, NEVER
            if frag.index == 0:
                self.round_steps.append(self._round_steps)
        else:
            period = self._period()
            frag.next_sync = self.inner_step + max(period, 1)
        return [dataclasses.replace(e, next_period=period) if e.kind == "launch" else e for e in events]

    def adopt(self, tag: str, pending: PendingMean, *, committed_at: float | None = None) -> list[SyncEvent]:
        """Healing: this engine was just loaded with a live member's state, taken as that member
        launched exchange ``tag``; ``pending`` is this group's part in that exchange (it sent
        nothing: its weight is 0). Finishes the sync as the member does, so both continue alike.
        ``committed_at`` (time rounds): when that exchange committed, on ``clock``: the next round
        runs from then, as the members' do, so a state transfer that ended later shortens this
        group's first round instead of making the others wait for it."""
        match = re.fullmatch(r"f(\d+)/r(\d+)", tag)
        if match is None or int(match.group(1)) >= len(self.fragments):
            raise ValueError(f"cannot join exchange {tag!r}: not a fragment sync of this engine")
        p, r = int(match.group(1)), int(match.group(2))
        frag = self.fragments[p]
        if frag.round != r:
            raise ValueError(f"exchange {tag!r} does not follow the loaded state (fragment {p} is at round {frag.round})")
        self.sync.adopt(frag)
        # SparseLoCo: the exchange ran in tile-major order, as the members' did
        events = self._after_launch(frag, [self._launched(frag, self.feedback.joined(p, pending))])
        self.round_clock.adopted(p, r, committed_at, self.inner_step)
        self.last_events = events
        return events

    def _period(self) -> int:
        """H of the round starting now; 0 once the schedule's total steps are done."""
        total = getattr(self.schedule, "total_steps", None)
        if total is not None and self.inner_step >= total:
            return 0
        return self.schedule.period(self.inner_step, self.current_lr())

    # --- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue bit-identically: per fragment the global parameters,
        outer-optimizer state, round, next sync and the exchange in flight (waited for here —
        its value does not depend on when it is read — and stored as its result), plus the
        step counter. The model's own (local) parameters and the inner optimizer are the
        caller's to save."""
        frags = [{**frag.state_dict(), **frag.sync_state(), "residual": self.feedback.state_of(frag.index)}
                 for frag in self.fragments]
        schedule = getattr(self.schedule, "state_dict", None)  # a schedule with a state (--h/--codec auto)
        return {"version": STATE_VERSION, "mode": self.mode, "inner_step": self.inner_step,
                "finished": self.finished, "fragments": frags, "schedule": schedule() if schedule else None}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved and load the global parameters into the model (load
        the model's own state dict afterwards to resume mid-round exactly)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"engine state version {state.get('version')!r}, expected {STATE_VERSION}")
        if state["mode"] != self.mode:
            raise ValueError(f"engine state is for mode {state['mode']!r}, this engine runs {self.mode!r}")
        frags = state["fragments"]
        if [f["names"] for f in frags] != [frag.names for frag in self.fragments]:
            raise ValueError("engine state has other fragments (parameter names) than this engine")
        for frag, saved in zip(self.fragments, frags):
            frag.load_state_dict(saved)
            frag.load_sync_state(saved)
            self.feedback.load(frag.index, saved.get("residual"), frag.local_numel, frag.global_params[0].device)
            frag.merge_into_model(0.0)
        self.inner_step = int(state["inner_step"])
        self.finished = bool(state["finished"])
        load = getattr(self.schedule, "load_state_dict", None)  # a state saved by a fixed schedule is None
        if load is not None and state.get("schedule") is not None:
            load(state["schedule"])
        self._changed()


SyncResult = SyncEvent  # the name of one release ago
