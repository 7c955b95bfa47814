"""The coordinator's state: membership (``joins.py``) and liveness (``liveness.py``), the rounds (``round_state.py``:
asks and quorums; ``vote_state.py``: votes, commits and state offers), and what groups report
besides (progress, round hashes, bandwidth plans), with the views observers read (``snapshot``,
waiting for the groups' summaries).

Thread-safe (one condition variable, shared by all its parts), independent of gRPC: handlers
call these methods and turn :class:`~diloco.coordinator.quorum.QuorumError` into a status code.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from typing import Any, Callable

from . import quorum, rounds
from .messages import BandwidthRequest, ProgressRequest, RoundRequest
from .round_state import MAX_ROUNDS_KEPT
from .vote_state import VoteState

MAX_PINS_KEPT = 4096  # exchange -> plan version pins kept, oldest dropped first


class CoordinatorState(VoteState):
    """Everything the coordinator knows; all times are ``clock()`` seconds (monotonic)."""

    def __init__(self, expected_groups: int, *, join_timeout_s: float = 120.0,
                 heartbeat_timeout_s: float = 15.0, max_group_size: int = 64, min_groups: int = 1,
                 outlier_factor: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 quorum_grace_s: float = 0.0) -> None:
        super().__init__(expected_groups, join_timeout_s=join_timeout_s,
                         heartbeat_timeout_s=heartbeat_timeout_s, max_group_size=max_group_size,
                         min_groups=min_groups, outlier_factor=outlier_factor, clock=clock,
                         quorum_grace_s=quorum_grace_s)
        self._progress: dict[int, dict[str, Any]] = {}
        self._progress_by_rank: dict[int, dict[int, dict[str, Any]]] = {}
        self._rounds: dict[int, int] = {}
        self._hashes: OrderedDict[int, dict[int, str]] = OrderedDict()
        self._divergence: OrderedDict[int, dict[int, str]] = OrderedDict()
        self._bandwidth: dict[int, dict[int, dict[int, float]]] = {}  # group -> rank -> rates
        self._plans: list[dict[int, dict[int, dict[int, float]]]] = [{}]  # version -> table
        self._pins: OrderedDict[int, int] = OrderedDict()  # exchange -> version

    # --- reports ------------------------------------------------------------------------------

    def progress(self, req: ProgressRequest) -> int:
        """Keep a member's latest progress dict (also counts as a sign of life unless failed)."""
        with self._cond:
            self._check_open()
            self._sweep()
            key = (req.group, req.rank)
            if req.group not in self._incarnations:
                self._known(req.group, req.rank)
            if key not in self._failed and req.rank in self._members.get(req.group, {}):
                self._last_heard[key] = self._clock()
            self._progress[req.group] = dict(req.progress)
            self._progress_by_rank.setdefault(req.group, {})[req.rank] = dict(req.progress)
            return self._epoch_locked()

    def round(self, req: RoundRequest) -> int:
        """Record a group's parameter hash for a committed round; differing hashes of one round
        across groups are recorded as a divergence."""
        with self._cond:
            self._check_open()
            self._member_group(req.group)
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

    # --- network plan -------------------------------------------------------------------------

    def bandwidth(self, req: BandwidthRequest) -> int:
        """Record a rank's measured rates; once every member has reported, the table becomes a
        new plan version (used by exchanges not yet pinned)."""
        with self._cond:
            self._check_open()
            self._known(req.group, req.rank)
            never = [g for g in req.rates if g == req.group or g not in self._incarnations]
            if never:
                raise quorum.QuorumError("INVALID_ARGUMENT", f"rates for groups {never}: not peers of group {req.group}")
            # a peer that failed or was evicted since it was probed: its rate is dropped, not an error
            self._bandwidth.setdefault(req.group, {})[req.rank] = {g: r for g, r in req.rates.items() if g in self._members}
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
        """Block until every expected group ended for good (``rounds.job_finished``: a summary of
        its model or of its late join; one stopped by its own SIGTERM comes back); returns a copy
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
        return rounds.job_finished(self.expected_groups, self._summaries)

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
                "rounds_state": {
                    "boot": self.boot, "started": self._started, "min_groups": self.min_groups,
                    "heartbeat_timeout_s": self.heartbeat_timeout_s, "quorum_grace_s": self.quorum_grace_s,
                    "job_lost": self.job_lost, "halted": self.halted, "frontier": self.frontier,
                    "resume_step": self.resume_step, "resumed_behind": dict(sorted(self.resumed_behind.items())),
                    "behind": {g: sorted(b) for g, b in sorted(self._behind.items()) if b}, **self._counts,
                    "live_groups": sorted(self._live()), "healing_groups": sorted(self._healing),
                    "joined_late": sorted(self.joined_late),
                    "failed_groups": dict(sorted(self._group_failed.items())),
                    "incarnations": dict(sorted(self._incarnations.items())),
                    "last_quorum": self._last_quorum(), "stop": self._stop_reason,
                    "events": list(self._events.values()),
                },
            })

    def _last_quorum(self) -> dict[str, Any] | None:
        if not self._quorums:
            return None
        q, meta = next(reversed(self._quorums.values()))
        decided = self._decisions.get(q.id)
        return {"id": q.id, "exchange": q.exchange, "attempt": q.attempt, "groups": list(q.groups),
                "weights": dict(q.weights), "healers": list(q.healers),
                "decision": None if decided is None else ("committed" if decided[0] else "rolled_back")}
