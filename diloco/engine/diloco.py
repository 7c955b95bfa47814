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
* ``blocking``: average Δ_p over groups, outer step on θ_global[p], merge, continue;
* ``overlap`` (Streaming DiLoCo): launch the exchange and keep training; ``overlap_steps`` = τ
  inner steps later, apply the outer step and merge;
* ``eager`` (Kale et al. 2025): the exchange may take a whole round; the outer step uses this
  group's fresh Δ and the others' previous-round Δ,
  ``(Δ_own(t) + M·mean(t−H) − Δ_own(t−H)) / M`` (with a weighted quorum: ``mean(t−H) + s·(Δ_own(t) −
  Δ_own(t−H))``, s = this group's share of that mean); global copies differ slightly until ``close()``;
* ``delayed``: the previous round's mean, one round stale (for comparison);
* ``co2`` (Sun et al. 2024): like ``delayed``, with ``diloco.engine.outer.co2`` as outer optimizer;
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

import contextlib
import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
import torch.nn as nn

from compress.finite import all_finite
from diloco.engine.averaging import Averager, Done, PendingMean
from diloco.engine.error_feedback import Residuals
from diloco.engine.tiles import FromTiles, TileLayout
from diloco.engine.initial import agree
from diloco.engine.modes import MAX_FRAGMENTS, MODES, InitialSync, Mode
from diloco.engine.outer import OuterOptimizerFactory, by_mode
from diloco.engine.outer_state import OuterFragment, global_weights_loaded, params_hash
from diloco.engine.round_clock import RoundClock
from diloco.engine.schedule import FixedSchedule, SyncSchedule, TimeRounds, longest_round
from diloco.engine.sharded import ShardedState

STATE_VERSION = 1
NEVER = 2**62  # next_sync of a time round: it ends by the clock, not at a step


class NonFiniteError(FloatingPointError):
    """A pseudo-gradient (local or averaged) holds NaN or Inf; nothing was applied."""


@dataclass(frozen=True)
class SyncEvent:
    """One thing the engine did to one fragment at an inner step."""

    fragment: int
    round: int  # this fragment's round id (0-based)
    kind: Literal["launch", "commit"]  # launch: exchange started; commit: outer step applied
    inner_step: int  # inner steps done when it happened
    numel: int  # elements of this fragment (the exchange's vector length)
    next_period: int = 0  # launch: H until this fragment's next sync (0: none before the end)
    delta_norm: float | None = None  # commit: L2 norm of the applied pseudo-gradient (None: none)


def first_syncs(num_fragments: int, h: int) -> list[int]:
    """Inner-step count of each fragment's first sync: ``(p+1)·H/P`` (floor), staggered."""
    if h < num_fragments:
        raise ValueError(f"H ({h}) must be >= the number of fragments ({num_fragments})")
    return [((p + 1) * h) // num_fragments for p in range(num_fragments)]


@dataclass
class _InFlight:
    pending: PendingMean
    round: int
    apply_at: int  # inner step at which an ``overlap`` exchange is merged


class DiLoCo:
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
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if averager is None:
            raise ValueError("averager is required: diloco.connect(...) for groups, diloco.SingleGroup() for one")
        if getattr(averager, "error_feedback", False) and mode == "eager":
            raise ValueError("mode 'eager' cannot use a codec that needs error feedback (int2, sign1, topk): its "
                             "own-share correction assumes the mean holds this group's exact Δ")
        # α = 0.5 only where τ local steps ran since Δ was measured (overlap); the other modes step at
        # the sync itself, and their papers start the next round from the new θ_global (α = 0).
        merge_alpha = (0.5 if mode == "overlap" else 0.0) if merge_alpha is None else merge_alpha
        if not 0.0 <= merge_alpha <= 1.0:
            raise ValueError(f"merge_alpha must be in [0, 1], got {merge_alpha}")
        tau = (1 if mode == "overlap" else 0) if overlap_steps is None else overlap_steps
        if tau < 0:
            raise ValueError(f"overlap_steps must be >= 0, got {overlap_steps}")
        if tau and mode != "overlap":
            raise ValueError(f"overlap_steps applies to mode 'overlap' only, not {mode!r}")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.schedule: SyncSchedule = FixedSchedule(sync_every) if isinstance(sync_every, int) else sync_every
        bind = getattr(self.schedule, "bind", None)  # a schedule that acts on its engine (--codec auto's switches)
        if bind is not None:
            bind(self)
        self.mode: Mode = mode
        self.overlap_steps = tau
        self.merge_alpha = merge_alpha
        self.averager = averager
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not named:
            raise ValueError("the model has no trainable parameters")
        groups = self._fragment_names(model, named, fragments)
        if len(groups) > MAX_FRAGMENTS:
            raise ValueError(f"{len(groups)} fragments: at most {MAX_FRAGMENTS} (each keeps an exchange in flight, and "
                             "the coordinator refuses exchanges asked too far ahead of the job)")
        self.time_rounds = self.schedule if isinstance(self.schedule, TimeRounds) else None
        if self.time_rounds is not None and mode not in ("blocking", "overlap"):
            raise ValueError(f"rounds by time run with mode 'blocking' or 'overlap', not {mode!r}")
        self.clock = clock
        device = None if str(global_device) == "model" else torch.device(global_device)
        self.fragments = [
            OuterFragment(f, [named[n] for n in f], outer_optimizer=outer_optimizer or by_mode(mode), device=device)
            for f in groups
        ]
        #: a model sharded in the group (FSDP2): per-fragment layouts and the group's collectives
        self.sharded = ShardedState.of(self.fragments, averager)
        attach = getattr(averager, "attach", None)  # fault-tolerant averagers: a late group heals instead
        healing = bool(attach(self)) if attach is not None else False
        if not healing:
            if self.sharded is not None:
                self.sharded.agree(averager, self.global_params, initial_sync)
            else:
                agree(averager, self.global_params, initial_sync)
        for frag in self.fragments:
            frag.merge_into_model(0.0)
        self._changed()
        #: rounds by time, a healer's catch-up (``diloco.engine.round_clock``); made after the initial
        #: exchange, which every group leaves together: rounds by time count from there on every group
        self.round_clock = RoundClock(len(groups), self.time_rounds, overlap=mode == "overlap", clock=clock,
                                      vote=round_vote)
        self.inner_step = 0
        self.next_sync = [NEVER] * len(self.fragments) if self.time_rounds is not None else \
            first_syncs(len(self.fragments), self.schedule.period(0, self.current_lr()))
        self._skipping = False
        self.round_steps: list[int] = []  # time rounds: the inner steps this group trained in each round of fragment 0
        if self.time_rounds is None and self.overlap_steps and self.overlap_steps >= min(self.next_sync):
            raise ValueError(
                f"overlap_steps ({self.overlap_steps}) must be < H/P ({min(self.next_sync)}): "
                "a fragment's exchange must land before the next fragment is due"
            )
        self.rounds = [0] * len(self.fragments)
        self.in_flight: list[_InFlight | None] = [None] * len(self.fragments)
        self._own_previous: list[torch.Tensor | None] = [None] * len(self.fragments)
        self._launched_at = [0] * len(self.fragments)  # inner step of each fragment's last launch
        self._weighted = bool(getattr(averager, "weighted", False))
        self._screened = bool(getattr(averager, "screens_contributions", False))
        # sign1/topk: each fragment's residual of what this group's exchanges have not delivered yet
        rule = outer_optimizer or by_mode(mode)
        decay = getattr(rule, "error_decay", None)  # SparseLoCo's β; its tiles below
        if decay is not None and not getattr(averager, "error_feedback", False):
            raise ValueError(f"{rule!r} needs an averager with error feedback: a codec that needs one (--codec topk, int2 "
                             "or sign1), whose residual stands in for outer momentum")
        if not 0.0 <= residual_decay <= 1.0:
            raise ValueError(f"residual_decay must be in [0, 1], got {residual_decay}")
        if decay is not None and residual_decay != 1.0:
            raise ValueError(f"{rule!r} sets the residual's decay itself (its beta): no residual_decay with it")
        self.residual_decay = residual_decay if decay is None else decay
        self.error_feedback = Residuals(len(self.fragments), self.residual_decay) \
            if getattr(averager, "error_feedback", False) else None
        self._flushing: Residuals | None = None  # residuals still to send once (set_error_feedback(False))
        #: SparseLoCo: each fragment laid out tile-major before the residual and the codec see it
        self.tiles = self._tile_layouts(getattr(rule, "tile", None) if decay is not None else None)
        self.final_codec = final_codec
        if final_codec is not None:
            self._check_final_codec(final_codec)
        self.finished = False
        self.sync_seconds = 0.0  # time spent inside step()/close() on syncs
        self.last_events: list[SyncEvent] = []
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step) if hook_optimizer else None
        if healing:
            averager.heal(self)

    def _tile_layouts(self, tile: int | None) -> list[TileLayout] | None:
        if tile is None:
            return None
        if self.sharded is not None:
            raise ValueError("SparseLoCo's tiles need each group's whole tensors; with a sharded model use "
                             "sparseloco(tile=None) (top-k over chunks of each rank's flat shards)")
        chunk = getattr(getattr(self.averager, "codec", None), "chunk", tile * tile)
        if chunk != tile * tile:
            raise ValueError(f"SparseLoCo's {tile}x{tile} tiles need the codec's chunk to be {tile * tile} values, "
                             f"not {chunk} (--codec-block {tile * tile})")
        return [TileLayout([tuple(g.shape) for g in frag.global_params], tile) for frag in self.fragments]

    @staticmethod
    def _fragment_names(model: nn.Module, named: dict, fragments) -> list[list[str]]:
        if fragments is None:
            return [list(named)]
        if isinstance(fragments, int):
            from diloco.engine.fragments import partition

            return partition(model, fragments)
        groups = [list(f) for f in fragments]
        seen = [n for f in groups for n in f]
        if sorted(seen) != sorted(named) or len(seen) != len(set(seen)):
            raise ValueError("fragments must cover every trainable parameter exactly once")
        return groups

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
                self.next_sync[p] = self.inner_step
        events: list[SyncEvent] = []
        for p, flight in enumerate(self.in_flight):
            if self.mode == "overlap" and flight is not None and self.inner_step >= flight.apply_at:
                events.append(self._commit_overlap(p))
        for p in range(len(self.fragments)):
            if self.inner_step >= self.next_sync[p]:
                events.extend(self._sync(p))
        return self._done(events, t0)

    @property
    def catching_up(self) -> bool:
        """A group that healed into rounds of fixed H, until it launches its first exchange as a
        member: ``steps_behind`` may say to count steps untrained (``skip_step``)."""
        return self.round_clock.catch_up is not None

    def steps_behind(self) -> int:
        """How many inner steps this group trails the others by while ``catching_up``: the members
        started their round when the exchange it joined committed, it only once its state transfer
        ended. The steps they have made since, at this group's own step time, less the steps it
        made; never the steps up to its next launch (it trains at least that one). 0 until it has
        timed a step. In a group of several ranks, rank 0's count (``round_vote``), so every rank
        skips alike; every rank calls it at every step of the catch-up."""
        return self.round_clock.steps_behind(self.inner_step, min(self.next_sync))

    def skip_step(self) -> list[SyncEvent]:
        """Count one inner step this group did not train (``steps_behind``): the schedule moves
        on as for a trained step, and its contributions weigh only the steps it trained."""
        self._launched_at = [a + 1 for a in self._launched_at]
        self._skipping = True
        try:
            return self.step()
        finally:
            self._skipping = False

    @property
    def max_round_steps(self) -> int | None:
        """The most inner steps one fragment's exchange can carry under the schedule (the bound of
        a contribution's weight, ``schedule.longest_round``); None when nothing bounds a round."""
        return longest_round(self.schedule)

    def progress(self) -> float:
        """The job's progress in [0, 1]: with time rounds, rounds committed and this round's time
        elapsed (``time_progress``, alike on every group); else inner steps over the schedule's
        total steps (0 without one)."""
        if self.time_rounds is not None:
            return self.round_clock.progress(self.rounds[0])
        total = getattr(self.schedule, "total_steps", None)
        return min(self.inner_step / total, 1.0) if total else 0.0

    @property
    def rounds_done(self) -> bool:
        """Time rounds: every round of every fragment has been launched (the training loop ends)."""
        return self.time_rounds is not None and min(self.rounds) >= self.time_rounds.rounds

    def _after_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step()

    def _done(self, events: list[SyncEvent], t0: float) -> list[SyncEvent]:
        if events:
            self.sync_seconds += time.perf_counter() - t0
        self.last_events = events
        observe = getattr(self.averager, "observe", None)
        if observe is not None:
            observe(self, events)
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
        events: list[SyncEvent] = []
        for p, flight in enumerate(self.in_flight):
            if flight is None:
                continue
            if self.mode in ("overlap", "blocking"):
                events.append(self._commit_overlap(p))
                continue
            mean = self._wait(p, flight)
            if self.mode in ("delayed", "co2"):  # eager already used its own share of it
                self.fragments[p].outer_step(mean)
                events.append(self._event(p, flight.round, "commit", delta_norm=self._norm(mean)))
        if self.mode == "eager":
            for p, frag in enumerate(self.fragments):
                frag.load_flat_global(self.averager.start(frag.flat_global(), tag=f"f{p}/final", exact=True,
                                                          **self._shards(p)).wait())
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
        self.in_flight = [None] * len(self.fragments)
        self.finished = True

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    # --- one fragment's sync ------------------------------------------------------------------

    def _event(self, p: int, round: int, kind: str, **extra: Any) -> SyncEvent:
        return SyncEvent(p, round, kind, self.inner_step, self.fragments[p].numel, **extra)  # type: ignore[arg-type]

    def _shards(self, p: int) -> dict[str, Any]:
        """The averager's ``shards=`` argument for fragment p: its layout when sharded, else none."""
        return {} if self.sharded is None else {"shards": self.sharded.layouts[p]}

    def _norm(self, flat: torch.Tensor) -> float:
        """L2 norm of a fragment's vector: of the whole fragment (every rank's shard) when sharded."""
        return float(flat.norm()) if self.sharded is None else self.sharded.norm(flat)

    def _changed(self) -> None:
        """The global parameters changed: a sharded engine hashes them now (a collective of the
        group, at the same point on every rank), so ``global_hash()`` never needs one."""
        if self.sharded is not None:
            self.sharded.rehash(self.fragments)

    def _delta(self, p: int) -> torch.Tensor:
        delta = self.fragments[p].pseudo_gradient()
        if not self._screened and not all_finite(delta):
            raise NonFiniteError(
                f"fragment {p} round {self.rounds[p]}: local pseudo-gradient has NaN/Inf at inner "
                f"step {self.inner_step}; nothing was sent or applied"
            )
        return delta

    def _wait(self, p: int, flight: _InFlight) -> torch.Tensor:
        mean = flight.pending.wait()
        self.in_flight[p] = None
        if not all_finite(mean):
            raise NonFiniteError(f"fragment {p} round {flight.round}: averaged pseudo-gradient has NaN/Inf; not applied")
        if getattr(flight.pending, "own_rejected", False):
            self._reset_local(p)
        return mean

    @torch.no_grad()
    def _reset_local(self, p: int) -> None:
        """The quorum refused this group's contribution (NaN/Inf or an outlier): its local state is
        not to be trusted, so fragment p's parameters restart from the global ones and their
        inner-optimizer state is dropped."""
        frag = self.fragments[p]
        frag.merge_into_model(0.0)
        for param in frag.local_params:
            self.inner_optimizer.state.pop(param, None)

    def set_error_feedback(self, on: bool) -> None:
        """The averager switched codec between launches (``--codec auto`` following the link, on
        every group at the same launch): keep a residual per fragment from the next launch on
        (each starts at zero), or stop keeping them. A residual holds what earlier exchanges
        did not deliver yet, so when they stop each fragment adds its residual once to its next
        Δ, which the new codec sends; nothing is lost. SparseLoCo's rule needs its residuals."""
        if on == (self.error_feedback is not None):
            return
        if on:  # residuals not yet flushed are still owed: keep them
            self.error_feedback, self._flushing = self._flushing or Residuals(len(self.fragments), self.residual_decay), None
            return
        if self.tiles is not None:
            raise ValueError("SparseLoCo's outer rule needs error feedback: its codec must keep one")
        self._flushing, self.error_feedback = self.error_feedback, None

    def _launch(self, p: int, delta: torch.Tensor) -> SyncEvent:
        r = self.rounds[p]
        extra = {"weight": float(self.inner_step - self._launched_at[p])} if self._weighted else {}
        extra.update(self._shards(p))
        owed = self._flushing.take(p) if self._flushing is not None else None
        if owed is not None:  # error feedback stopped; this fragment's last exchange with it has landed
            delta = delta + owed.to(delta.device)
        if self.error_feedback is not None:  # sends Δ + residual; the residual moves when it lands
            if self.tiles is not None:  # residual and codec in tile-major order, the mean back in place
                layout = self.tiles[p]
                landing = self.error_feedback.start(self.averager, p, layout.to_tiles(delta), tag=f"f{p}/r{r}", **extra)
                return self._launched(p, FromTiles(landing, layout))
            return self._launched(p, self.error_feedback.start(self.averager, p, delta, tag=f"f{p}/r{r}", **extra))
        pending = self.averager.start(delta, tag=f"f{p}/r{r}", **extra)
        return self._launched(p, pending)

    def _launched(self, p: int, pending: PendingMean) -> SyncEvent:
        r = self.rounds[p]
        apply_at = self.inner_step + (self.overlap_steps if self.mode in ("overlap", "blocking") else 0)
        self.in_flight[p] = _InFlight(pending, r, apply_at)
        self.rounds[p] += 1
        self._round_steps = self.inner_step - self._launched_at[p]
        self._launched_at[p] = self.inner_step
        return self._event(p, r, "launch")

    def _sync(self, p: int) -> list[SyncEvent]:
        events, delta = self._before_launch(p)
        if self.final_codec is not None and self._last_launch(p) and self.averager.codec is not self.final_codec:
            self.averager.set_codec(self.final_codec)  # every group at the same launch: the same step or round
            self.set_error_feedback(bool(getattr(self.final_codec, "requires_error_feedback", False)))
        events.append(self._launch(p, delta))
        return self._after_launch(p, events)

    def _last_launch(self, p: int) -> bool:
        """Whether fragment p's launch now is its last of the job."""
        if self.time_rounds is not None:
            return self.rounds[p] + 1 >= self.time_rounds.rounds
        total = getattr(self.schedule, "total_steps", None)
        return total is not None and self.inner_step >= total

    def _check_final_codec(self, codec: Any) -> None:
        if getattr(codec, "requires_error_feedback", False):
            raise ValueError(f"the final codec {codec.name} keeps a residual itself: the last exchange would leave "
                             "one behind; use one without error feedback (fp32, bf16, int8, int4, ...)")
        if self.tiles is not None:
            raise ValueError("SparseLoCo's outer rule needs error feedback to the end: no final codec with it")
        if self.mode == "eager":
            raise ValueError("mode 'eager' reconciles its last round exactly: no final codec with it")
        if not callable(getattr(self.averager, "set_codec", None)) or not hasattr(self.averager, "codec"):
            raise ValueError(f"{type(self.averager).__name__} cannot switch codecs: no final codec with it")
        if self.time_rounds is None and getattr(self.schedule, "total_steps", None) is None:
            raise ValueError("a final codec needs a schedule that knows its last step (total_steps)")

    def _before_launch(self, p: int) -> tuple[list[SyncEvent], torch.Tensor]:
        """What a fragment's sync does before its exchange starts: land what is due, and the
        contribution to send."""
        events = []
        frag = self.fragments[p]
        if self.mode in ("overlap", "blocking"):
            if self.in_flight[p] is not None:  # only if H shrank below τ: land it first
                events.append(self._commit_overlap(p))
            return events, self._delta(p)
        delta = self._delta(p)
        flight = self.in_flight[p]
        update = None
        if self.mode == "eager":
            m = self.averager.num_groups
            if flight is None:  # round 0: nothing from the others yet
                update = delta / m
            else:
                mean = self._wait(p, flight)
                # this group's part of that mean: w_own / sum(w) of the quorum that committed it
                # (0 if it was refused or healing in); averagers without quorums: 1/M
                share = getattr(flight.pending, "own_share", None)
                if share is None:
                    update = (delta + (m * mean - self._own_previous[p])) / m
                elif share == 0:  # refused or healing: the mean holds nothing of ours to replace
                    update = mean.clone()
                else:
                    update = mean + share * (delta - self._own_previous[p])
            self._own_previous[p] = delta
        elif flight is not None:  # delayed, co2: the previous round's mean, one round stale
            update = self._wait(p, flight)
        if update is not None:
            frag.outer_step(update)
            self._changed()
        frag.merge_into_model(self.merge_alpha)
        norm = None if update is None else self._norm(update)
        events.append(self._event(p, self.rounds[p], "commit", delta_norm=norm))
        return events, delta

    def _after_launch(self, p: int, events: list[SyncEvent]) -> list[SyncEvent]:
        if self.mode in ("overlap", "blocking") and self.overlap_steps == 0:
            events.append(self._commit_overlap(p))
        self.round_clock.launched(p)
        if self.time_rounds is not None:
            period, self.next_sync[p] = 0, NEVER
            if p == 0:
                self.round_steps.append(self._round_steps)
        else:
            period = self._period()
            self.next_sync[p] = self.inner_step + max(period, 1)
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
        if self.rounds[p] != r:
            raise ValueError(f"exchange {tag!r} does not follow the loaded state (fragment {p} is at round {self.rounds[p]})")
        if self.mode == "eager":
            self._own_previous[p] = torch.zeros_like(self.fragments[p].flat_global())
        if self.tiles is not None:  # SparseLoCo: the exchange ran in tile-major order, as the members' did
            pending = FromTiles(pending, self.tiles[p])
        events = self._after_launch(p, [self._launched(p, pending)])
        self.round_clock.adopted(p, r, committed_at, self.inner_step)
        self.last_events = events
        return events

    def _commit_overlap(self, p: int) -> SyncEvent:
        flight = self.in_flight[p]
        assert flight is not None
        frag = self.fragments[p]
        mean = self._wait(p, flight)
        frag.outer_step(mean)
        self._changed()
        frag.merge_into_model(self.merge_alpha)
        if getattr(flight.pending, "own_rejected", False):
            self._reset_local(p)
        return self._event(p, flight.round, "commit", delta_norm=self._norm(mean))

    def _period(self) -> int:
        """H of the round starting now; 0 once the schedule's total steps are done."""
        total = getattr(self.schedule, "total_steps", None)
        if total is not None and self.inner_step >= total:
            return 0
        return self.schedule.period(self.inner_step, self.current_lr())

    # --- the global model -----------------------------------------------------------------------

    @property
    def global_params(self) -> list[torch.Tensor]:
        """The fp32 global parameters, in fragment order."""
        return [g for f in self.fragments for g in f.global_params]

    @property
    def local_params(self) -> list[torch.Tensor]:
        """The model's trainable parameters, in fragment order (DTensors when sharded)."""
        return [p for f in self.fragments for p in f.local_params]

    @property
    def names(self) -> list[str]:
        return [n for f in self.fragments for n in f.names]

    @property
    def numel(self) -> int:
        """Trainable parameters (elements) the engine syncs (of the whole model when sharded)."""
        return sum(f.numel for f in self.fragments)

    @property
    def local_numel(self) -> int:
        """Elements this rank's global copy holds (``numel`` unless sharded)."""
        return sum(f.local_numel for f in self.fragments)

    @property
    def round(self) -> int:
        """Fragment syncs launched so far, over all fragments (the rounds with one fragment)."""
        return sum(self.rounds)

    def pseudo_gradient(self) -> torch.Tensor:
        """Flat fp32 ``θ_global − θ_local`` of every fragment, on the global copy's device (this
        rank's shards, concatenated, when sharded)."""
        return torch.cat([f.pseudo_gradient() for f in self.fragments])

    def global_hash(self) -> str:
        """`params_hash` of the global parameters, in fragment order (16 hex chars). Sharded: of
        the whole model (every rank's shard), the same number as unsharded for the same values;
        computed collectively whenever they change, so calling it needs no collective."""
        if self.sharded is not None:
            return self.sharded.hash
        return params_hash(self.global_params)

    def fragment_hash(self, p: int) -> str:
        """`params_hash` of fragment p's global parameters (this rank's shard when sharded)."""
        return params_hash(self.fragments[p].global_params)

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The global (outer) parameters by name, fp32: what is evaluated and saved (sharded:
        DTensors laid out like the model's parameters)."""
        if self.sharded is not None:
            return self.sharded.global_state_dict(self.fragments)
        return {n: g.detach().clone() for f in self.fragments for n, g in zip(f.names, f.global_params)}

    def global_weights(self) -> contextlib.AbstractContextManager[nn.Module]:
        """Temporarily load the global parameters into the model (e.g. for eval)."""
        return global_weights_loaded(self.model, self.global_params, [v for f in self.fragments for v in f.local_views()])

    # --- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue bit-identically: per fragment the global parameters,
        outer-optimizer state, round, next sync and the exchange in flight (waited for here —
        its value does not depend on when it is read — and stored as its result), plus the
        step counter. The model's own (local) parameters and the inner optimizer are the
        caller's to save."""
        frags = []
        for p, frag in enumerate(self.fragments):
            flight = self.in_flight[p]
            landed = None
            if flight is not None:
                mean = flight.pending.wait()
                flight.pending = Done(mean)
                landed = {"mean": mean.detach().clone(), "round": flight.round, "apply_at": flight.apply_at}
            own = self._own_previous[p]
            frags.append({
                **frag.state_dict(), "names": list(frag.names), "round": self.rounds[p],
                "next_sync": self.next_sync[p], "launched_at": self._launched_at[p], "in_flight": landed,
                "own_previous": None if own is None else own.detach().clone(),
                "residual": None if self.error_feedback is None else self.error_feedback.state_of(p),
            })
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
        for p, (frag, saved) in enumerate(zip(self.fragments, frags)):
            frag.load_state_dict(saved)
            self.rounds[p] = int(saved["round"])
            self.next_sync[p] = int(saved["next_sync"])
            self._launched_at[p] = int(saved.get("launched_at", 0))
            landed = saved["in_flight"]
            self.in_flight[p] = None if landed is None else _InFlight(
                Done(landed["mean"].to(frag.global_params[0].device)), int(landed["round"]), int(landed["apply_at"]))
            own = saved["own_previous"]
            self._own_previous[p] = None if own is None else own.to(frag.global_params[0].device)
            if self.error_feedback is not None:  # absent (None) in states saved without error feedback
                numel = frag.local_numel if self.tiles is None else self.tiles[p].padded_numel
                self.error_feedback.load(p, saved.get("residual"), numel, frag.global_params[0].device)
            frag.merge_into_model(0.0)
        self.inner_step = int(state["inner_step"])
        self.finished = bool(state["finished"])
        load = getattr(self.schedule, "load_state_dict", None)  # a state saved by a fixed schedule is None
        if load is not None and state.get("schedule") is not None:
            load(state["schedule"])
        self._changed()


SyncResult = SyncEvent  # the name of one release ago
