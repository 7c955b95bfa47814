"""The synchronization schedule's spec: the schedules by name, what each is built from, its checks.

``SCHEDULES`` is the registry (``--schedule``'s choices: fixed, QSR, paced); rounds by time
(``round_seconds`` > 0) replace any of them with ``TimeRounds``. ``ScheduleSpec`` holds H and the
schedules' settings with the run's length and inner-lr shape they plan over, checks them
(``problems``: one sentence each) and builds the schedule the engine takes (``build``). Torch-free.

A new schedule: its class in ``schedule.py`` and one entry in ``SCHEDULES``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from diloco.engine.schedule import (FixedSchedule, PacedSchedule, QSRSchedule, SyncSchedule, TimeRounds,
                                    paced_sync_steps)

#: the schedules by name: how each is built from a spec
SCHEDULES: dict[str, Callable[["ScheduleSpec"], SyncSchedule]] = {
    "fixed": lambda s: FixedSchedule(s.h, total_steps=s.total_steps, h_max=s.h_max or None),
    "qsr": lambda s: QSRSchedule(h_base=s.h, alpha=s.qsr_alpha_in_force, gamma=s.qsr_gamma,
                                 warmup_steps=s.warmup_steps, total_steps=s.total_steps, h_max=s.h_max or None),
    "paced": lambda s: PacedSchedule(s.h, s.total_steps, gamma=s.paced_gamma, lr_schedule=s.lr_schedule,
                                     min_ratio=s.min_lr_ratio),
}
#: the bound on ``paced_gamma``'s size (periods grow as (peak / lr) ** gamma)
PACED_GAMMA_MAX = 4.0


def schedule_names() -> tuple[str, ...]:
    """The schedules' names, in ``SCHEDULES`` order."""
    return tuple(SCHEDULES)


@dataclass(frozen=True)
class ScheduleSpec:
    """How H, the inner steps between a fragment's syncs, is chosen over a run of ``total_steps``."""

    name: str = "fixed"
    h: int | None = 30  # fixed: H; qsr: H_base; paced: the mean H (ceil(total_steps / h) syncs); None: not decided yet
    total_steps: int = 300
    h_max: int = 0  # 0: only the remaining steps bound H (fixed, qsr)
    qsr_alpha: float = -1.0  # -1: peak_lr * h ** (1 / qsr_gamma), H = H_base at the peak lr
    qsr_gamma: float = 2.0
    paced_gamma: float = 0.5
    round_seconds: float = 0.0  # > 0: rounds by time, ceil(total_steps / h) of them
    # the inner lr the schedules follow: its peak, warmup and decay
    peak_lr: float = 1e-3
    warmup_steps: int = 0
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1

    @property
    def qsr_alpha_in_force(self) -> float:
        """QSR's alpha: ``qsr_alpha``, or for -1 the one that gives H = H_base at the peak inner lr, so
        H grows by (peak / lr) ** gamma as the lr decays, whatever the lr's scale."""
        if self.qsr_alpha >= 0:
            return self.qsr_alpha
        return self.peak_lr * self.h ** (1.0 / self.qsr_gamma)

    def shortest_paced_period(self) -> int:
        """The shortest period of the paced plan over this run (ValueError when it cannot be planned)."""
        points = paced_sync_steps(self.total_steps, -(-self.total_steps // self.h), self.paced_gamma,
                                  self.lr_schedule, self.min_lr_ratio)
        return min(b - a for a, b in zip((0, *points), points))

    def problems(self) -> list[str]:
        """What is wrong with these settings, one sentence each (empty: ``build`` makes the schedule)."""
        out: list[str] = []
        for check in _CHECKS:
            problem = check(self)
            if problem:
                out.append(problem)
        return out

    def build(self) -> Any:
        """The schedule: rounds by time when ``round_seconds`` > 0, else ``SCHEDULES[name]``."""
        if self.h is None:
            raise ValueError("no H to build a schedule with: --h auto decides it (diloco/job/auto_choice.py)")
        if self.round_seconds > 0:  # as many rounds as fixed H would run, each of round_seconds
            return TimeRounds(self.round_seconds, math.ceil(self.total_steps / self.h))
        if self.name not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.name!r}; choose {', '.join(SCHEDULES)}")
        return SCHEDULES[self.name](self)


def _qsr(s: ScheduleSpec) -> str | None:
    wrong = [] if s.qsr_alpha == -1.0 or 0.0 <= s.qsr_alpha <= 1.0 else \
        [f"--qsr-alpha must be in [0, 1] (or -1 for peak lr x H_base^(1/gamma)), got {s.qsr_alpha}"]
    wrong += [] if s.qsr_gamma > 0 else [f"--qsr-gamma must be > 0, got {s.qsr_gamma}"]
    return "\n  ".join(wrong) or None


def _h_max(s: ScheduleSpec) -> str | None:
    return None if s.h_max == 0 or s.h is None or s.h_max >= s.h else f"--h-max must be 0 or >= --h ({s.h}), got {s.h_max}"


def _paced(s: ScheduleSpec) -> str | None:
    if s.name != "paced" or s.h is None:
        return None
    wrong = [] if s.h_max == 0 else ["--h-max bounds the fixed and QSR schedules, not 'paced' (its longest period "
                                     "is set by --h and --paced-gamma)"]
    if math.isfinite(s.paced_gamma) and abs(s.paced_gamma) > PACED_GAMMA_MAX:
        wrong.append(f"--paced-gamma must be in [-{PACED_GAMMA_MAX:g}, {PACED_GAMMA_MAX:g}], got {s.paced_gamma}")
    elif math.isfinite(s.paced_gamma) and s.h >= 1 and s.total_steps >= 1:  # (not: reported by their own checks)
        try:
            s.shortest_paced_period()
        except ValueError as e:
            wrong.append(f"--schedule paced with --h {s.h} over --steps {s.total_steps}: {e}")
    return "\n  ".join(wrong) or None


_CHECKS = (_qsr, _h_max, _paced)
