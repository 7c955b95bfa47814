"""A fault drill: kill worker groups at random moments and start them again after a pause.

``diloco run --chaos N`` and ``bench/churn.py`` use it. The decisions are a pure function of the
random generator and what the caller reports (which groups are up and healthy, how far the job
is), so a drill is reproducible from its seed; the caller does the killing (SIGKILL of the
group's whole process tree, wherever it stands: inside a collective, a vote, a heal) and the
restarting.

Rules: a group is killed only while it is up and a healthy live member of the job (not healing,
not killed earlier and not yet healed back), only if at least one other such group would remain
(someone must hold the state to heal from), and only before ``stop_fraction`` of the job's steps; a killed group is restarted after a pause drawn from
``pause_s``; kills are spaced by gaps drawn from ``gap_s`` (seconds).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class ChaosPlan:
    """What the drill wants done now: groups to kill, groups to start again."""

    kill: list[int] = field(default_factory=list)
    restart: list[int] = field(default_factory=list)


class ChaosMonkey:
    """Decides kills and restarts; call ``tick`` often (every fraction of a second)."""

    def __init__(self, kills: int, *, seed: int = 0, gap_s: tuple[float, float] = (2.0, 6.0),
                 pause_s: tuple[float, float] = (0.5, 3.0), stop_fraction: float = 0.8) -> None:
        if kills < 0:
            raise ValueError(f"kills must be >= 0, got {kills}")
        if not (0 <= gap_s[0] <= gap_s[1] and 0 <= pause_s[0] <= pause_s[1]):
            raise ValueError("gap_s and pause_s must be (low, high) with 0 <= low <= high")
        self.kills_left = kills
        self.kills_done = 0
        self.rng = random.Random(seed)
        self.gap_s, self.pause_s, self.stop_fraction = gap_s, pause_s, stop_fraction
        self._next_kill_at: float | None = None
        self._down: dict[int, float] = {}  # group -> when to restart it
        # killed groups not yet back: "drop" until the coordinator no longer counts them live (it
        # noticed), then "heal" until it counts them live again (healed). Only groups outside this
        # map count as healthy, so a stale "live" from the coordinator never lets the drill kill
        # the last group holding the job's state.
        self._recovering: dict[int, str] = {}

    def tick(self, now: float, *, live: set[int], running: set[int], progress: float) -> ChaosPlan:
        """``now``: seconds (any monotonic clock). ``live``: groups the coordinator counts as live
        members. ``running``: groups whose processes run. ``progress``: fraction of the job's steps
        done (0..1). Returns the kills and restarts to do now."""
        plan = ChaosPlan()
        for g, phase in list(self._recovering.items()):
            if phase == "drop" and g not in live:
                self._recovering[g] = "heal"
            elif phase == "heal" and g in live:
                del self._recovering[g]
        for g, at in sorted(self._down.items()):
            if now >= at:
                plan.restart.append(g)
                del self._down[g]
        if self._next_kill_at is None:
            self._next_kill_at = now + self.rng.uniform(*self.gap_s)
        if self.kills_left <= 0 or now < self._next_kill_at or progress >= self.stop_fraction:
            return plan
        healthy = sorted(g for g in live & running if g not in self._down and g not in self._recovering)
        if len(healthy) < 2:
            return plan
        victim = self.rng.choice(healthy)
        plan.kill.append(victim)
        self._down[victim] = now + self.rng.uniform(*self.pause_s)
        self._recovering[victim] = "drop"
        self.kills_left -= 1
        self.kills_done += 1
        self._next_kill_at = now + self.rng.uniform(*self.gap_s)
        return plan

    @property
    def down(self) -> set[int]:
        """Groups killed and not yet due for a restart."""
        return set(self._down)
