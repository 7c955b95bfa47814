"""The coordinator's state: membership, liveness, progress, round hashes, summaries.

Thread-safe (one condition variable), independent of gRPC: handlers call these methods and turn
:class:`~diloco.coordinator.quorum.QuorumError` into a status code.

Liveness: once the quorum is complete, a member not heard from (join, heartbeat, progress) for
``heartbeat_timeout_s`` is marked failed. A failed member's heartbeats are refused until it joins
again with the same address. Nothing else happens yet: evicting it from the membership, bumping
the epoch and re-forming the ring without it is future work.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from . import quorum
from .membership import Membership
from .messages import (BandwidthRequest, HeartbeatRequest, JoinRequest, ProgressRequest,
                       RoundRequest, SummaryRequest)

MAX_ROUNDS_KEPT = 1024  # round hashes and divergences kept, oldest dropped first
MAX_PINS_KEPT = 4096  # exchange -> plan version pins kept, oldest dropped first
_POLL_S = 0.25  # how often a waiting join re-checks whether its caller is still there


class CoordinatorState:
    """Everything the coordinator knows; all times are ``clock()`` seconds (monotonic)."""

    def __init__(self, expected_groups: int, *, join_timeout_s: float = 120.0,
                 heartbeat_timeout_s: float = 30.0, max_group_size: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if expected_groups < 1:
            raise ValueError(f"expected_groups must be >= 1, got {expected_groups}")
        if join_timeout_s <= 0 or heartbeat_timeout_s <= 0:
            raise ValueError("join_timeout_s and heartbeat_timeout_s must be > 0")
        self.expected_groups = expected_groups
        self.join_timeout_s = join_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_group_size = max_group_size
        self._clock = clock
        self._cond = threading.Condition()
        self._closed = False
        self._members: dict[int, dict[int, str]] = {}
        self._sizes: dict[int, int] = {}
        self._waiting: dict[tuple[int, int], int] = {}  # joins in flight per member
        self._membership: Membership | None = None
        self._complete_at = 0.0
        self._last_heard: dict[tuple[int, int], float] = {}
        self._failed: dict[tuple[int, int], float] = {}  # member -> seconds silent when marked
        self._steps: dict[tuple[int, int], int] = {}
        self._progress: dict[int, dict[str, Any]] = {}
        self._progress_by_rank: dict[int, dict[int, dict[str, Any]]] = {}
        self._summaries: dict[int, dict[str, Any]] = {}
        self._rounds: dict[int, int] = {}
        self._hashes: OrderedDict[int, dict[int, str]] = OrderedDict()
        self._divergence: OrderedDict[int, dict[int, str]] = OrderedDict()
        self._bandwidth: dict[int, dict[int, dict[int, float]]] = {}  # group -> rank -> rates
        self._plans: list[dict[int, dict[int, dict[int, float]]]] = [{}]  # version -> table
        self._pins: OrderedDict[int, int] = OrderedDict()  # exchange -> version

    # --- membership ---------------------------------------------------------------------------

    def join(self, req: JoinRequest, *, deadline: float,
             active: Callable[[], bool] = lambda: True) -> Membership:
        """Register a rank and wait until the quorum is complete.

        ``deadline`` is a ``clock()`` time; reaching it raises QuorumError(DEADLINE_EXCEEDED)
        naming the missing members. ``active`` returning False (the caller went away) raises
        CANCELLED. Rejections raise QuorumError with INVALID_ARGUMENT or FAILED_PRECONDITION.
        """
        key = (req.group, req.rank)
        with self._cond:
            self._check_open()
            admission = quorum.admit(
                self._members, self._sizes, self.expected_groups, self.max_group_size,
                req.group, req.rank, req.group_size, req.address,
                may_replace=self._membership is None and self._waiting.get(key, 0) == 0)
            if admission is not quorum.Admission.SAME:
                self._members.setdefault(req.group, {})[req.rank] = req.address
                self._sizes[req.group] = req.group_size
            self._failed.pop(key, None)
            self._last_heard[key] = self._clock()
            if self._membership is None and quorum.is_complete(
                    self._members, self._sizes, self.expected_groups):
                self._form()
            self._waiting[key] = self._waiting.get(key, 0) + 1
            try:
                while self._membership is None:
                    self._check_open()
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        absent = quorum.missing(self._members, self._sizes, self.expected_groups)
                        raise quorum.QuorumError(
                            "DEADLINE_EXCEEDED",
                            f"join of group {req.group} rank {req.rank} timed out waiting for: "
                            f"{quorum.describe_missing(absent, self._sizes)}")
                    if not active():
                        raise quorum.QuorumError("CANCELLED", "the joining caller went away")
                    self._cond.wait(min(remaining, _POLL_S))
                return self._membership
            finally:
                self._waiting[key] -= 1

    def _form(self) -> None:
        """Freeze the complete membership (caller holds the lock)."""
        members = {g: tuple(ranks[r] for r in range(self._sizes[g]))
                   for g, ranks in sorted(self._members.items())}
        self._membership = Membership(epoch=1, members=members,
                                      ring=tuple(quorum.ring_order(members)))
        self._complete_at = self._clock()
        self._cond.notify_all()

    @property
    def epoch(self) -> int:
        """Membership epoch; 0 until the quorum first forms."""
        with self._cond:
            return 0 if self._membership is None else self._membership.epoch

    # --- liveness -----------------------------------------------------------------------------

    def _sweep(self) -> None:
        """Mark members silent for longer than heartbeat_timeout_s as failed (lock held)."""
        if self._membership is None:
            return  # ranks block in join until the quorum forms; they cannot heartbeat yet
        now = self._clock()
        heard = {k: max(t, self._complete_at) for k, t in self._last_heard.items()
                 if k not in self._failed}
        for key in quorum.stale(heard, now, self.heartbeat_timeout_s):
            self._failed[key] = now - heard[key]

    def _known(self, group: int, rank: int) -> tuple[int, int]:
        key = (group, rank)
        if rank not in self._members.get(group, {}):
            raise quorum.QuorumError("NOT_FOUND", f"group {group} rank {rank} has not joined")
        return key

    def heartbeat(self, req: HeartbeatRequest) -> int:
        """Record that a member is alive at ``step``; returns the epoch. A failed member is
        refused with FAILED_PRECONDITION until it joins again."""
        with self._cond:
            self._check_open()
            key = self._known(req.group, req.rank)
            self._sweep()
            if key in self._failed:
                raise quorum.QuorumError(
                    "FAILED_PRECONDITION",
                    f"group {req.group} rank {req.rank} was marked failed after "
                    f"{self._failed[key]:.1f}s without a message (heartbeat_timeout_s="
                    f"{self.heartbeat_timeout_s:g}); join again to continue")
            self._last_heard[key] = self._clock()
            self._steps[key] = req.step
            return self._epoch_locked()

    # --- reports ------------------------------------------------------------------------------

    def progress(self, req: ProgressRequest) -> int:
        """Keep a member's latest progress dict (also counts as a sign of life unless failed)."""
        with self._cond:
            self._check_open()
            key = self._known(req.group, req.rank)
            self._sweep()
            if key not in self._failed:
                self._last_heard[key] = self._clock()
            self._progress[req.group] = dict(req.progress)
            self._progress_by_rank.setdefault(req.group, {})[req.rank] = dict(req.progress)
            return self._epoch_locked()

    def round(self, req: RoundRequest) -> int:
        """Record a group's parameter hash for a committed round; differing hashes of one round
        across groups are recorded as a divergence."""
        with self._cond:
            self._check_open()
            self._known_group(req.group)
            self._rounds[req.group] = max(req.round, self._rounds.get(req.group, req.round))
            hashes = self._hashes.setdefault(req.round, {})
            hashes[req.group] = req.param_hash
            self._hashes.move_to_end(req.round)
            while len(self._hashes) > MAX_ROUNDS_KEPT:
                self._hashes.popitem(last=False)
            if quorum.diverged(hashes):
                self._divergence[req.round] = dict(hashes)
                while len(self._divergence) > MAX_ROUNDS_KEPT:
                    self._divergence.popitem(last=False)
            else:
                self._divergence.pop(req.round, None)
            return self._epoch_locked()

    def summary(self, req: SummaryRequest) -> int:
        """Keep a group's final summary (the latest wins) and wake wait_for_summaries and
        wait_finished."""
        with self._cond:
            self._check_open()
            self._known_group(req.group)
            self._summaries[req.group] = copy.deepcopy(req.summary)
            self._cond.notify_all()
            return self._epoch_locked()

    # --- network plan -------------------------------------------------------------------------

    def bandwidth(self, req: BandwidthRequest) -> int:
        """Record a rank's measured rates; once every member has reported, the table becomes a
        new plan version (used by exchanges not yet pinned)."""
        with self._cond:
            self._check_open()
            self._known(req.group, req.rank)
            unknown = [g for g in req.rates if g not in self._members or g == req.group]
            if unknown:
                raise quorum.QuorumError("INVALID_ARGUMENT", f"rates for groups {unknown}: not peers of group {req.group}")
            self._bandwidth.setdefault(req.group, {})[req.rank] = dict(req.rates)
            everyone = all(len(self._bandwidth.get(g, {})) == self._sizes[g] for g in self._members)
            if self._membership is not None and everyone and self._bandwidth != self._plans[-1]:
                self._plans.append(copy.deepcopy(self._bandwidth))
            return self._epoch_locked()

    def plan(self, exchange: int) -> tuple[int, dict[int, dict[int, dict[int, float]]]]:
        """(version, table) governing ``exchange``: pinned by the first request for it, so every
        rank of every group uses the same plan for the same exchange."""
        with self._cond:
            self._check_open()
            if exchange not in self._pins:
                if self._pins and exchange < next(iter(self._pins)):
                    raise quorum.QuorumError("OUT_OF_RANGE", f"exchange {exchange} is older than the pins kept")
                self._pins[exchange] = len(self._plans) - 1
                while len(self._pins) > MAX_PINS_KEPT:
                    self._pins.popitem(last=False)
            version = self._pins[exchange]
            return version, copy.deepcopy(self._plans[version])

    def _known_group(self, group: int) -> None:
        if group not in self._members:
            raise quorum.QuorumError("NOT_FOUND", f"group {group} has no joined rank")

    # --- observers ----------------------------------------------------------------------------

    def wait_for_summaries(self, n: int, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Block until ``n`` groups reported a summary; returns a copy ``{group: summary}``.
        Raises TimeoutError naming the groups still silent."""
        if not 1 <= n <= self.expected_groups:
            raise ValueError(f"n must be in [1, {self.expected_groups}], got {n}")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._summaries) < n:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    silent = [g for g in range(self.expected_groups) if g not in self._summaries]
                    why = "coordinator stopped" if self._closed else f"{timeout_s:g}s passed"
                    raise TimeoutError(f"{why} with {len(self._summaries)} of {n} summaries; "
                                       f"no summary yet from groups {silent}")
                self._cond.wait(remaining)
            return copy.deepcopy(self._summaries)

    def wait_finished(self, timeout_s: float | None = None) -> dict[int, dict[str, Any]] | None:
        """Block until every expected group reported a summary; returns a copy
        ``{group: summary}``, or None if ``timeout_s`` seconds passed first (None: no limit) or
        the state was closed first."""
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._finished_locked():
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closed or (remaining is not None and remaining <= 0):
                    return None
                self._cond.wait(remaining)
            return copy.deepcopy(self._summaries)

    def _finished_locked(self) -> bool:
        return all(g in self._summaries for g in range(self.expected_groups))

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the state; see CoordinatorServer.snapshot for the keys."""
        with self._cond:
            self._sweep()
            return copy.deepcopy({
                "expected_groups": self.expected_groups,
                "epoch": self._epoch_locked(),
                "complete": self._membership is not None,
                "groups": {g: {"ranks": dict(sorted(ranks.items())),
                               "group_size": self._sizes[g]}
                           for g, ranks in sorted(self._members.items())},
                "ring_order": [] if self._membership is None else self._membership.ring_order,
                "steps": {g: {r: s for (gg, r), s in sorted(self._steps.items()) if gg == g}
                          for g in sorted({g for g, _ in self._steps})},
                "progress": self._progress,
                "progress_by_rank": {g: dict(sorted(by_rank.items()))
                                     for g, by_rank in sorted(self._progress_by_rank.items())},
                "summaries": self._summaries,
                "rounds": self._rounds,
                "failed": [{"group": g, "rank": r, "silent_s": round(s, 3)}
                           for (g, r), s in sorted(self._failed.items())],
                "divergence": [{"round": r, "hashes": h}
                               for r, h in sorted(self._divergence.items())],
                "plan_version": len(self._plans) - 1,
                "bandwidth": self._bandwidth,
            })

    def close(self) -> None:
        """Refuse further calls and release every waiting join, wait_for_summaries and
        wait_finished."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """True once close() was called."""
        with self._cond:
            return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise quorum.QuorumError("UNAVAILABLE", "the coordinator is shutting down")

    def _epoch_locked(self) -> int:
        return 0 if self._membership is None else self._membership.epoch
