"""``diloco run``'s supervisor: keeps every group's process tree running until the job ends.

A group whose process exits for a fault (75, "restart me", or killed by a signal:
``exit_codes.restartable``) is started again, up to ``max_restarts`` times; the new processes join
as a new incarnation and heal into the job (docs/fault_tolerance.md). A group that exits with a
configuration error (2) or another error (1) is not: a restart would repeat it, so the run stops
with the group's own error lines.
A fault drill (``diloco.runtime.launch.chaos.Drill``, e.g. its ``ChaosMonkey``) may kill groups on purpose; those are started again
when the drill says (after their host's pause; at once where a warm spare is ready), and do not count
against ``max_restarts``.
With ``spares`` (``--spares N``) N warm spares (``diloco.runtime.launch.spare``) are kept started: a group
restarted (after a fault or by the drill) becomes the oldest live spare at once, and a new spare
is started in its place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from diloco.runtime.launch.chaos import Drill
from diloco.runtime.ops import exit_codes
from diloco.runtime.ops.processes import freeze_tree, kill_tree


class GroupProcess(Protocol):
    group: int
    proc: Any
    log_path: Path

    def tail(self, lines: int = 20) -> str: ...


class GroupFailed(RuntimeError):
    """A group failed in a way a restart cannot fix, or more often than it may be restarted."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code  # the group's exit code


@dataclass
class Supervisor:
    """``spawn(group, attempt)`` starts a group's process tree (attempt 0, 1, ...)."""

    spawn: Callable[[int, int], GroupProcess]
    groups: int
    max_restarts: int
    chaos: Drill | None = None
    #: flips a bit of what a group receives next (the drill's ``corrupt`` faults; see link_relays)
    corrupt_link: Callable[[int], None] | None = None
    #: warm spares: how many to keep, ``start_spare()`` starts one (an object with ``proc``), and
    #: ``assign(spare, group, attempt)`` makes it that group's process tree
    spares: int = 0
    start_spare: Callable[[], Any] | None = None
    assign: Callable[[Any, int, int], GroupProcess] | None = None
    #: told at once when a group's process tree ended for a fault (group, why), before it is
    #: started again: the coordinator fails it then instead of after its heartbeats stop
    on_exit: Callable[[int, str], Any] | None = None
    procs: dict[int, GroupProcess] = field(default_factory=dict)
    restarts: dict[int, int] = field(default_factory=dict)  # failures restarted, per group
    attempts: dict[int, int] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    frozen: list[dict[str, Any]] = field(default_factory=list)  # the drill's stalls: group, at_s
    corrupted: list[dict[str, Any]] = field(default_factory=list)  # the drill's bit flips: group, at_s
    finished: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    ready: list[Any] = field(default_factory=list)  # spares started, oldest first
    spares_used: list[dict[str, Any]] = field(default_factory=list)  # group, at_s

    def start(self) -> None:
        if self.spares and (self.start_spare is None or self.assign is None):
            raise ValueError("spares need start_spare and assign")
        for g in range(self.groups):
            self._spawn(g)
        self._refill()

    def _spawn(self, g: int) -> None:
        self.attempts[g] = self.attempts.get(g, -1) + 1
        spare = self._take_spare() if self.attempts[g] else None
        if spare is None:
            self.procs[g] = self.spawn(g, self.attempts[g])
            return
        self.procs[g] = self.assign(spare, g, self.attempts[g])
        self.spares_used.append({"group": g, "at_s": round(time.monotonic() - self.started, 3)})
        self._refill()

    def _spare_ready(self) -> bool:
        return any(s.proc.poll() is None for s in self.ready)

    def _take_spare(self) -> Any:
        """The oldest spare still running (one that died, e.g. with the host's memory, is dropped)."""
        while self.ready:
            spare = self.ready.pop(0)
            if spare.proc.poll() is None:
                return spare
        return None

    def _refill(self) -> None:
        while len(self.ready) < self.spares:
            self.ready.append(self.start_spare())

    def poll(self, *, live: set[int], progress: float, committed: int = 1) -> bool:
        """Check every group, restart the failed ones, run the drill; True once every group
        exited 0. Raises GroupFailed when a group exits with a code no restart fixes, is out of
        restarts, or fails before the job committed its first training exchange (``committed``
        0: a setup error such as a coordinator that cannot be reached from one group, which a
        restart would only repeat); the drill starts once it has."""
        down = self.chaos.down if self.chaos is not None else set()
        for g, p in list(self.procs.items()):
            code = p.proc.poll()
            if code is None or g in down:
                continue
            if code == 0:
                self.finished.add(g)
                continue
            if g in self.finished:
                continue
            if not exit_codes.restartable(code):
                raise GroupFailed(f"group {g} exited with code {exit_codes.describe(code)}, which a restart "
                                  f"would repeat; last lines of {p.log_path}:\n{p.tail()}", code)
            if not committed:
                raise GroupFailed(f"group {g} exited with code {exit_codes.describe(code)} before the job's first "
                                  f"training exchange committed; last lines of {p.log_path}:\n{p.tail()}", code)
            if self.restarts.get(g, 0) >= self.max_restarts:
                raise GroupFailed(f"group {g} exited with code {exit_codes.describe(code)} and was restarted "
                                  f"{self.max_restarts} time(s) already (--max-restarts); last lines of "
                                  f"{p.log_path}:\n{p.tail()}", code)
            self._exited(g, f"its process exited with code {exit_codes.describe(code)}")
            self.restarts[g] = self.restarts.get(g, 0) + 1
            self.failures.append({"group": g, "code": code, "at_s": round(time.monotonic() - self.started, 3),
                                  "log": str(p.log_path)})
            self._spawn(g)
        if self.chaos is not None and committed:  # a group lost before that is not restarted (above)
            running = {g for g, p in self.procs.items() if p.proc.poll() is None}
            plan = self.chaos.tick(time.monotonic(), live=live, running=running, progress=progress)
            for g in plan.kill:
                kill_tree(self.procs[g].proc)
                self._exited(g, "its process was killed (SIGKILL, the fault drill)")
                self.kills.append({"group": g, "at_s": round(time.monotonic() - self.started, 3)})
                if self._spare_ready():  # the drill's pause is the killed host's; a spare on another does not wait
                    self.chaos.replaced(g)
                    self._spawn(g)
            for g in plan.restart:
                self._spawn(g)
            for g in plan.stall:
                freeze_tree(self.procs[g].proc, True)
                self.frozen.append({"group": g, "at_s": round(time.monotonic() - self.started, 3)})
            for g in plan.resume:
                freeze_tree(self.procs[g].proc, False)
            for g in plan.corrupt:
                if self.corrupt_link is None:
                    raise ValueError("the drill asked for a corrupting link, but no relays are in front of the groups")
                self.corrupt_link(g)
                self.corrupted.append({"group": g, "at_s": round(time.monotonic() - self.started, 3)})
        return len(self.finished) == self.groups and not down

    def _exited(self, g: int, why: str) -> None:
        if self.on_exit is not None:
            self.on_exit(g, why)

    def all_procs(self) -> list[Any]:
        """Every process tree this supervisor started and may still run: groups and spares (``proc``)."""
        return [*self.procs.values(), *self.ready]
