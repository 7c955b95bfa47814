"""A fault drill: kill worker groups at random moments and start them again after a pause.

``diloco run --chaos N``, ``bench/churn.py`` and ``bench/goodput.py`` use it. The decisions are a
pure function of the random generator and what the caller reports (which groups are up and
healthy, how far the job is), so a drill is reproducible from its seed; the caller does the
killing (SIGKILL of the group's whole process tree, wherever it stands: inside a collective, a
vote, a heal) and the restarting.

Faults of kind ``stall`` (``kinds``) freeze a group instead: its whole process tree stops
(SIGSTOP, as a hung host, a long pause or a preempted VM) for a time drawn from ``stall_s``, then
goes on (SIGCONT). Its links stay open and carry nothing, and it stops heartbeating: the others
must not wait for it longer than the heartbeat timeout. A stall longer than that timeout gets
the group declared failed; it learns so as it wakes, exits "restart me", and the caller restarts
it, as after a kill.

Faults of kind ``corrupt`` flip one bit of what a group receives next (the caller does it, with a
relay in front of the group's data plane, ``diloco.runtime.launch.link_relays``): the group stays up; the
frame fails its check, that exchange rolls back and runs again.

Rules: a group is killed only while it is up and a healthy live member of the job (not healing,
not killed earlier and not yet healed back), only if at least one other such group would remain
(someone must hold the state to heal from), and only before ``stop_fraction`` of the job's steps;
a killed group is restarted after a pause drawn from ``pause_s`` (its host's restart; with a warm
spare ready the caller starts it there at once and says so, ``replaced``); faults are spaced by gaps
drawn from ``gap_s`` (seconds).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from diloco.job.config import CHAOS_KINDS


KINDS = CHAOS_KINDS


@dataclass
class ChaosPlan:
    """What the drill wants done now: groups to kill, to start again, to freeze, to wake, and
    groups whose next received bytes get a bit flipped."""

    kill: list[int] = field(default_factory=list)
    restart: list[int] = field(default_factory=list)
    stall: list[int] = field(default_factory=list)
    resume: list[int] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)


class Drill(Protocol):
    """What the supervisor asks of a fault drill (``ChaosMonkey``, or a test's own)."""

    kills_done: int  # faults done so far

    @property
    def down(self) -> set[int]:
        """Groups the drill holds down: killed and not yet due for a restart, or frozen."""
        ...

    def tick(self, now: float, *, live: set[int], running: set[int], progress: float) -> ChaosPlan:
        """What to do now (``ChaosMonkey.tick``)."""
        ...

    def replaced(self, group: int) -> None:
        """A killed ``group`` was started again at once, from a warm spare."""
        ...


class ChaosMonkey:
    """Decides kills and restarts; call ``tick`` often (every fraction of a second)."""

    def __init__(self, kills: int, *, seed: int = 0, gap_s: tuple[float, float] = (2.0, 6.0),
                 pause_s: tuple[float, float] = (0.5, 3.0), stop_fraction: float = 0.8,
                 kinds: tuple[str, ...] = ("kill",), stall_s: tuple[float, float] = (10.0, 10.0)) -> None:
        """``kills``: faults in all (of every kind); ``kinds``: each fault's kind is drawn from
        these (``KINDS``); ``stall_s``: how long a stalled group stays frozen (s): make it longer
        than the job's heartbeat timeout, so that the group is declared failed and heals."""
        if kills < 0:
            raise ValueError(f"kills must be >= 0, got {kills}")
        if not (0 <= gap_s[0] <= gap_s[1] and 0 <= pause_s[0] <= pause_s[1] and 0 <= stall_s[0] <= stall_s[1]):
            raise ValueError("gap_s, pause_s and stall_s must be (low, high) with 0 <= low <= high")
        if not kinds or any(k not in KINDS for k in kinds):
            raise ValueError(f"kinds must be some of {KINDS}, got {kinds}")
        self.kills_left = kills
        self.kills_done = 0
        self.rng = random.Random(seed)
        self.gap_s, self.pause_s, self.stop_fraction = gap_s, pause_s, stop_fraction
        self.kinds, self.stall_s = tuple(kinds), stall_s
        self._next_kill_at: float | None = None
        self._down: dict[int, float] = {}  # group -> when to restart (killed) or wake (stalled) it
        self._stalled: set[int] = set()  # groups of _down that are frozen, not killed
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
                (plan.resume if g in self._stalled else plan.restart).append(g)
                self._stalled.discard(g)
                del self._down[g]
        if self._next_kill_at is None:
            self._next_kill_at = now + self.rng.uniform(*self.gap_s)
        if self.kills_left <= 0 or now < self._next_kill_at or progress >= self.stop_fraction:
            return plan
        healthy = sorted(g for g in live & running if g not in self._down and g not in self._recovering)
        if len(healthy) < 2:
            return plan
        victim = self.rng.choice(healthy)
        # one kind draws nothing: a kill-only drill's choices stay those of its seed
        kind = self.kinds[0] if len(self.kinds) == 1 else self.rng.choice(self.kinds)
        if kind == "corrupt":  # the group stays up and a live member
            plan.corrupt.append(victim)
        elif kind == "stall":
            plan.stall.append(victim)
            self._stalled.add(victim)
            self._down[victim] = now + self.rng.uniform(*self.stall_s)
            self._recovering[victim] = "drop"
        else:
            plan.kill.append(victim)
            self._down[victim] = now + self.rng.uniform(*self.pause_s)
            self._recovering[victim] = "drop"
        self.kills_left -= 1
        self.kills_done += 1
        self._next_kill_at = now + self.rng.uniform(*self.gap_s)
        return plan

    def replaced(self, group: int) -> None:
        """A killed ``group`` was started again at once (a warm spare took its place): no restart is
        due for it after its pause; it counts as healthy again once the coordinator has it back."""
        if group not in self._stalled:
            self._down.pop(group, None)

    @property
    def down(self) -> set[int]:
        """Groups killed and not yet due for a restart, or frozen and not yet due to wake."""
        return set(self._down)
