"""Synchronization schedules and the inner learning-rate schedule, as pure functions.

Every group evaluates these on the same inputs (step, current inner lr, config), so all groups
agree on when to sync without exchanging a message.

* Fixed H: sync every ``h`` inner steps.
* QSR (Gu et al., ICLR 2024): ``H = max(H_base, floor((alpha / lr) ** gamma))``, with
  ``H = H_base`` during lr warmup (as in the reference code), recomputed after every sync from the
  current inner lr. ``alpha = 0`` gives constant ``H_base``.
* Paced: as many syncs as fixed H makes (the same bits), planned before the run so that H grows as
  the lr decays, ``H ~ (peak / lr) ** gamma``: short periods early, long ones late.

All are capped by the steps that remain (so the last sync lands on the last step); fixed and QSR
also by ``h_max`` when given.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Any, Protocol


class SyncSchedule(Protocol):
    def period(self, step: int, lr: float) -> int:
        """Inner steps until the next sync, for a round starting after ``step`` steps at ``lr``."""
        ...


def _cap(h: float, step: int, total_steps: int | None, h_max: int | None) -> int:
    if total_steps is not None:
        remaining = total_steps - step
        if remaining < 1:
            raise ValueError(f"no inner steps remain: step {step} >= total_steps {total_steps}")
        h = min(h, remaining)
    if h_max:
        h = min(h, h_max)
    if math.isinf(h):
        raise ValueError("unbounded H: QSR at lr=0 needs total_steps or h_max")
    return max(int(h), 1)


def fixed_period(step: int, *, h: int, total_steps: int | None = None, h_max: int | None = None) -> int:
    """Fixed H, capped by the remaining steps."""
    if h < 1:
        raise ValueError(f"H must be >= 1, got {h}")
    return _cap(h, step, total_steps, h_max)


def qsr_period(
    step: int,
    lr: float,
    *,
    h_base: int,
    alpha: float,
    gamma: float = 2.0,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    h_max: int | None = None,
) -> int:
    """QSR: ``max(h_base, floor((alpha/lr)**gamma))`` after warmup, ``h_base`` during it."""
    if h_base < 1:
        raise ValueError(f"H_base must be >= 1, got {h_base}")
    if lr < 0 or not math.isfinite(lr):
        raise ValueError(f"learning rate must be finite and >= 0, got {lr}")
    if step < warmup_steps or alpha == 0:
        h: float = h_base
    elif lr == 0:
        h = math.inf
    else:
        ratio = (alpha / lr) ** gamma
        h = max(h_base, math.floor(ratio)) if math.isfinite(ratio) else math.inf
    return _cap(h, step, total_steps, h_max)


@dataclass(frozen=True)
class FixedSchedule:
    h: int
    total_steps: int | None = None
    h_max: int | None = None

    def period(self, step: int, lr: float) -> int:
        return fixed_period(step, h=self.h, total_steps=self.total_steps, h_max=self.h_max)


@dataclass(frozen=True)
class QSRSchedule:
    h_base: int
    alpha: float
    gamma: float = 2.0
    warmup_steps: int = 0
    total_steps: int | None = None
    h_max: int | None = None

    def period(self, step: int, lr: float) -> int:
        return qsr_period(
            step, lr, h_base=self.h_base, alpha=self.alpha, gamma=self.gamma,
            warmup_steps=self.warmup_steps, total_steps=self.total_steps, h_max=self.h_max,
        )


@functools.lru_cache(maxsize=8)
def paced_sync_steps(total_steps: int, syncs: int, gamma: float, lr_schedule: str = "cosine",
                     min_ratio: float = 0.1) -> tuple[int, ...]:
    """The inner-step counts after which a paced run syncs: ``syncs`` of them, the last one
    ``total_steps``, placed so that the density of syncs follows ``lr ** gamma`` along the inner lr's
    decay, i.e. H proportional to ``(peak / lr) ** gamma`` (gamma 0: every ``total_steps / syncs``
    steps, as fixed H; a negative gamma shortens the periods as the lr decays). Only the decay's
    shape counts (peak 1, no warmup: a near-zero lr during the warmup would push every sync out of
    it), so every group plans the same steps. Syncs that would share a step are spread one step
    apart."""
    if not 1 <= syncs <= total_steps:
        raise ValueError(f"syncs must be in [1, total_steps={total_steps}], got {syncs}")
    if not math.isfinite(gamma):
        raise ValueError(f"gamma must be finite, got {gamma}")
    # the lr before each step, > 0 even at a min ratio of 0 (the cosine reaches it after the last step)
    density = [inner_lr(t, peak=1.0, warmup_steps=0, total_steps=total_steps, schedule=lr_schedule,
                        min_ratio=min_ratio) ** gamma for t in range(total_steps)]
    scale, reached, ideal = syncs / math.fsum(density), 0.0, []
    for t, d in enumerate(density):
        reached += d * scale
        while len(ideal) < syncs - 1 and reached >= len(ideal) + 1 - 1e-9:
            ideal.append(t + 1)
    points: list[int] = []
    for k, p in enumerate(ideal, 1):  # the k-th sync after the one before it, leaving a step for each after it
        points.append(min(max(p, points[-1] + 1 if points else 1), total_steps - (syncs - k)))
    return (*points, total_steps)


@dataclass(frozen=True)
class PacedSchedule:
    """``ceil(total_steps / h)`` syncs, as fixed ``h`` makes, at ``paced_sync_steps``. A round that
    starts inside a planned period (a fragment staggered off the plan) lasts that period, so the
    fragments keep their stagger while the periods grow."""

    h: int
    total_steps: int
    gamma: float = 0.5
    lr_schedule: str = "cosine"
    min_ratio: float = 0.1

    @property
    def points(self) -> tuple[int, ...]:
        return paced_sync_steps(self.total_steps, -(-self.total_steps // self.h), self.gamma, self.lr_schedule,
                                self.min_ratio)

    def period(self, step: int, lr: float) -> int:
        return planned_period(self.points, step)


def longest_round(schedule: Any) -> int | None:
    """The most inner steps one fragment's exchange can carry under ``schedule`` (its largest H,
    never more than its ``total_steps``), or None when nothing bounds it (rounds by time, QSR
    without ``h_max`` or ``total_steps``, a schedule of the user's own without either)."""
    bounds = [b for b in (getattr(schedule, "total_steps", None), getattr(schedule, "h_max", None)) if b]
    if isinstance(schedule, FixedSchedule):
        bounds.append(schedule.h)
    elif isinstance(schedule, PacedSchedule):
        points = (0, *schedule.points)
        bounds.append(max(b - a for a, b in zip(points, points[1:])))
    return max(min(bounds), 1) if bounds else None


def planned_period(points: tuple[int, ...] | list[int], step: int) -> int:
    """H of a round starting after ``step`` inner steps under a plan of sync steps ``points``
    (ascending, the last one the run's last step): the planned period it starts in, capped by the
    steps that remain. A round starting on a planned sync lasts until the next one."""
    i = bisect.bisect_right(points, step)  # the first planned sync after step
    start = points[i - 1] if i else 0
    return _cap(points[i] - start if i < len(points) else 1, step, points[-1], None)


def sync_steps(schedule: SyncSchedule, lrs: list[float]) -> list[int]:
    """Steps (1-based counts of inner steps done) at which syncs happen over ``len(lrs)`` steps.

    ``lrs[t]`` is the inner lr in force after ``t`` steps; handy for tests and for planning.
    """
    out, step = [], 0
    while step < len(lrs):
        step += schedule.period(step, lrs[step])
        out.append(step)
    return out


def inner_lr(
    step: int, *, peak: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
    min_ratio: float = 0.1,
) -> float:
    """Inner lr after ``step`` steps: linear warmup to ``peak``, then cosine to ``min_ratio*peak``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    if schedule != "cosine":
        raise ValueError(f"unknown lr schedule {schedule!r}")
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class TimeRounds:
    """Rounds by time, not steps: every group trains until the round's deadline, ``seconds``
    after the previous exchange committed (after the engine started, for the first), so groups
    that start together end together whatever their speed; ``rounds`` rounds in all. Each
    contribution then weighs its own inner steps (its tokens), not H."""

    seconds: float
    rounds: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"round seconds must be finite and > 0, got {self.seconds}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")

    def period(self, step: int, lr: float) -> int:
        """No step count: a time round ends by ``round_over`` (0: 'not a number of steps')."""
        return 0


def round_over(now: float, deadline: float, step_seconds: float) -> bool:
    """Whether a time round ends after the step that ended at ``now`` (seconds, any clock): when
    one more step of ``step_seconds`` would end further past ``deadline`` than stopping now falls
    short of it, i.e. ``now + step_seconds / 2 >= deadline``. Each group thus ends within half of
    its own step of the deadline, the fast and the slow alike."""
    if step_seconds < 0 or not math.isfinite(step_seconds):
        raise ValueError(f"step_seconds must be finite and >= 0, got {step_seconds}")
    return now + step_seconds / 2 >= deadline


def time_progress(rounds_done: int, elapsed: float, *, seconds: float, rounds: int) -> float:
    """The job's progress in [0, 1] under ``TimeRounds(seconds, rounds)``: rounds committed plus
    the part of this round's ``seconds`` elapsed (capped at 1), over ``rounds``. Every group computes
    the same value at the same moment whatever its speed: what the inner lr schedule follows."""
    if rounds_done >= rounds:
        return 1.0
    return (rounds_done + min(max(elapsed, 0.0) / seconds, 1.0)) / rounds
