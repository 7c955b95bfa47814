"""The coordinator's state: membership, liveness, progress, round hashes, summaries.

Thread-safe (one condition variable), independent of gRPC: handlers call these methods and turn
:class:`~diloco.coordinator.quorum.QuorumError` into a status code.

Liveness: once the job started, a rank not heard from (join, heartbeat, progress, quorum, vote)
for ``heartbeat_timeout_s`` fails its whole group: the group leaves the membership, every quorum
and vote it was part of is decided without it, and its later calls are refused (FAILED_PRECONDITION)
until it starts again under a new incarnation, when it joins as a healer.

Rounds (``rounds.py`` holds the rules): every exchange asks for a quorum (``quorum``), every rank
votes on it (``commit``), healers wait for their donor's state offer (``offer``/``wait_offer``).
"""

from __future__ import annotations

import copy
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from . import quorum, rounds
from .membership import Membership
from .messages import (BandwidthRequest, CommitRequest, CommitResponse, HeartbeatRequest, JoinRequest,
                       OfferQuery, ProgressRequest, QuorumRequest, QuorumResponse, RoundRequest,
                       StateOffer, SummaryRequest)

MAX_ROUNDS_KEPT = 1024  # round hashes and divergences kept, oldest dropped first
MAX_PINS_KEPT = 4096  # exchange -> plan version pins kept, oldest dropped first
_POLL_S = 0.25  # how often a waiting call re-checks liveness and whether its caller is still there
MAX_EVENTS_KEPT = 1024  # failures, rejections, rollbacks kept for snapshots, oldest dropped first
NORM_HISTORY = 8  # accepted contribution norms kept per group for the outlier screen
# votes on quorums of a previous coordinator (it restarted) that one group may make us remember: an
# honest group has at most a few exchanges in flight; without a bound, a group could push the
# other groups' live quorums out of memory with votes on made-up quorum ids
MAX_ORPHANS_PER_GROUP = 16


class CoordinatorState:
    """Everything the coordinator knows; all times are ``clock()`` seconds (monotonic)."""

    def __init__(self, expected_groups: int, *, join_timeout_s: float = 120.0,
                 heartbeat_timeout_s: float = 15.0, max_group_size: int = 64, min_groups: int = 1,
                 outlier_factor: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if expected_groups < 1:
            raise ValueError(f"expected_groups must be >= 1, got {expected_groups}")
        if join_timeout_s <= 0 or heartbeat_timeout_s <= 0:
            raise ValueError("join_timeout_s and heartbeat_timeout_s must be > 0")
        if not 1 <= min_groups <= expected_groups:
            raise ValueError(f"min_groups must be in [1, {expected_groups}], got {min_groups}")
        if outlier_factor < 0:
            raise ValueError(f"outlier_factor must be >= 0 (0: off), got {outlier_factor}")
        self.expected_groups = expected_groups
        self.min_groups = min_groups
        self.outlier_factor = outlier_factor
        self.boot = secrets.token_hex(4)  # names this coordinator's quorums apart from a predecessor's
        # a backstop: a member alive (heartbeating) but silent this long after a quorum's first vote
        # is stuck, and the round rolls back (members' rings end together; a healer's vote also
        # waits for its state transfer, which must fit in this)
        self.vote_timeout_s = join_timeout_s
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
        self._epoch = 0
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
        # fault tolerance (see rounds.py)
        self._started = False  # the job runs: the first membership formed, or a member rejoined us
        self._rejoin_grace_until = 0.0  # after our restart: no quorum before members could rejoin
        self._incarnations: dict[int, str] = {}
        self._group_failed: dict[int, str] = {}  # group -> why (until it starts again)
        self._healing: set[int] = set()  # joined while the job ran; a member once a quorum commits
        self._asks: dict[int, dict[int, dict[int, QuorumRequest]]] = {}  # exchange -> group -> rank
        self._answers: dict[tuple[int, int, int], tuple[str, Any]] = {}  # (group, rank, exchange asked) -> answer
        self._quorums: OrderedDict[str, tuple[rounds.Quorum, dict[str, Any]]] = OrderedDict()
        self._orphans_by_group: dict[int, int] = {}  # group -> orphan quorums it made us remember
        self._latest: OrderedDict[int, str] = OrderedDict()  # exchange -> id of its latest quorum
        self._votes: dict[str, dict[tuple[int, int], tuple[bool, str]]] = {}
        self._decisions: dict[str, tuple[bool, str]] = {}
        self._offers: dict[tuple[str, int, int], StateOffer] = {}
        self._norms: dict[int, list[float]] = {}
        self._asked_exchange: dict[int, int] = {}  # group -> latest exchange its rank 0 asked for
        self._first_ask: dict[int, float] = {}  # exchange -> when its first quorum request came
        self._last_members = 0  # contributing groups of the last committed quorum
        self._stop_reason: str | None = None
        self._counts = {"committed": 0, "committed_training": 0, "rolled_back": 0, "heals": 0, "failures": 0, "rejected": 0,
                        "evicted": 0}
        self._events: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._event_seq = 0
        self._started_at = clock()

    # --- membership ---------------------------------------------------------------------------

    def join(self, req: JoinRequest, *, deadline: float,
             active: Callable[[], bool] = lambda: True) -> Membership:
        """Register a rank; before the job runs, wait until every expected group has all its ranks.

        Once the job runs (the first membership formed), a group that joins — new, started again
        under a new incarnation, or declared failed earlier — joins as a *healer*: the call waits
        only for its own ranks, and the membership it returns says ``heal``. A join that says it
        is at an exchange (``exchange >= 0``) rejoins a restarted coordinator as a member.

        ``deadline`` is a ``clock()`` time; reaching it raises QuorumError(DEADLINE_EXCEEDED)
        naming the missing members. ``active`` returning False (the caller went away) raises
        CANCELLED. Rejections raise QuorumError with INVALID_ARGUMENT or FAILED_PRECONDITION.
        """
        key = (req.group, req.rank)
        with self._cond:
            self._check_open()
            if not self._started and req.exchange >= 0:
                self._start_running()  # our predecessor's job goes on: members rejoin us
                # every member rejoins within a heartbeat or so: no quorum forms before they could,
                # else the first to rejoin would run an exchange the others then find committed
                self._rejoin_grace_until = self._clock() + self.heartbeat_timeout_s
            if self._started:
                return self._join_running(req, deadline, active)
            if self._incarnations.get(req.group, req.incarnation) != req.incarnation:
                self._members.pop(req.group, None)  # the group started again before the job did
                self._sizes.pop(req.group, None)
            self._incarnations[req.group] = req.incarnation
            admission = quorum.admit(
                self._members, self._sizes, self.expected_groups, self.max_group_size,
                req.group, req.rank, req.group_size, req.address,
                may_replace=self._waiting.get(key, 0) == 0)
            if admission is not quorum.Admission.SAME:
                self._members.setdefault(req.group, {})[req.rank] = req.address
                self._sizes[req.group] = req.group_size
            self._failed.pop(key, None)
            self._last_heard[key] = self._clock()
            if quorum.is_complete(self._members, self._sizes, self.expected_groups):
                self._form()
            self._wait_joined(key, deadline, active, lambda: self._membership is not None,
                              lambda: quorum.missing(self._members, self._sizes, self.expected_groups))
            assert self._membership is not None
            return self._membership

    def _wait_joined(self, key: tuple[int, int], deadline: float, active: Callable[[], bool],
                     done: Callable[[], bool], missing: Callable[[], dict]) -> None:
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            while not done():
                self._check_open()
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise quorum.QuorumError(
                        "DEADLINE_EXCEEDED",
                        f"join of group {key[0]} rank {key[1]} timed out waiting for: "
                        f"{quorum.describe_missing(missing(), self._sizes)}")
                if not active():
                    raise quorum.QuorumError("CANCELLED", "the joining caller went away")
                self._cond.wait(min(remaining, _POLL_S))
        finally:
            self._waiting[key] -= 1

    def _join_running(self, req: JoinRequest, deadline: float, active: Callable[[], bool]) -> Membership:
        """A join while the job runs (lock held): see ``join``."""
        g, key = req.group, (req.group, req.rank)
        known = self._incarnations.get(g)
        if known is not None and known != req.incarnation:
            self._fail_group(g, "it started again (a new incarnation joined)")
            self._incarnations[g] = req.incarnation
        if known is None or known != req.incarnation or g in self._group_failed:
            if g in self._group_failed:
                self._group_failed.pop(g)
                self._members.pop(g, None)
                self._sizes.pop(g, None)
                for k in [k for k in self._failed if k[0] == g]:
                    del self._failed[k]
            self._incarnations[g] = req.incarnation
            if known is not None or req.exchange < 0:
                self._healing.add(g)
                self._event("joined", group=g, committed=self._counts["committed"])
            self._epoch += 1
        quorum.admit(self._members, self._sizes, self.expected_groups, self.max_group_size,
                     g, req.rank, req.group_size, req.address, may_replace=False)
        self._members.setdefault(g, {})[req.rank] = req.address
        self._sizes[g] = req.group_size
        self._failed.pop(key, None)
        self._last_heard[key] = self._clock()
        self._cond.notify_all()
        self._wait_joined(key, deadline, active, lambda: self._complete(g) or g in self._group_failed,
                          lambda: quorum.missing({g: self._members.get(g, {})}, {g: req.group_size}, g + 1))
        if g in self._group_failed:
            raise quorum.QuorumError("ABORTED", f"group {g} failed while it joined: {self._group_failed[g]}")
        members = {h: tuple(self._members[h][r] for r in range(self._sizes[h]))
                   for h in sorted(self._members) if self._complete(h) and h not in self._group_failed}
        return Membership(epoch=self._epoch, members=members, ring=tuple(sorted(members)),
                          heal=g in self._healing)

    def _complete(self, g: int) -> bool:
        return g in self._sizes and len(self._members.get(g, {})) == self._sizes[g]

    def _start_running(self) -> None:
        self._started = True
        self._complete_at = self._clock()
        self._epoch = max(self._epoch, 1)

    def _form(self) -> None:
        """Freeze the complete membership (caller holds the lock)."""
        members = {g: tuple(ranks[r] for r in range(self._sizes[g]))
                   for g, ranks in sorted(self._members.items())}
        self._membership = Membership(epoch=1, members=members,
                                      ring=tuple(quorum.ring_order(members)))
        self._start_running()
        self._cond.notify_all()

    @property
    def epoch(self) -> int:
        """Membership epoch: 0 until the job starts, then +1 on every change of members."""
        with self._cond:
            return self._epoch

    # --- liveness -----------------------------------------------------------------------------

    def _sweep(self) -> None:
        """Fail the groups of ranks silent for longer than heartbeat_timeout_s (lock held)."""
        if not self._started:
            return  # ranks block in join until the job starts; they cannot heartbeat yet
        now = self._clock()
        heard = {k: max(t, self._complete_at) for k, t in self._last_heard.items()
                 if k not in self._failed and k[0] not in self._summaries}  # finished groups go quiet
        for key in quorum.stale(heard, now, self.heartbeat_timeout_s):
            self._failed[key] = now - heard[key]
            self._fail_group(key[0], f"rank {key[1]} sent nothing for {now - heard[key]:.1f}s "
                                     f"(heartbeat_timeout_s={self.heartbeat_timeout_s:g})")

    def _fail_group(self, g: int, reason: str) -> None:
        """Take group ``g`` out of the job (lock held): its waiting calls are answered, every quorum
        and vote goes on without it, and it must join again (as a healer) to come back."""
        if g in self._group_failed or g not in self._incarnations:
            return
        self._group_failed[g] = reason
        self._counts["failures"] += 1
        self._event("failure", group=g, reason=reason)
        for r in self._members.get(g, {}):
            self._last_heard.pop((g, r), None)
        self._members.pop(g, None)
        self._healing.discard(g)
        for exchange, asks in self._asks.items():
            for r in asks.pop(g, {}):
                self._answers[(g, r, exchange)] = ("evicted", reason)
        self._epoch += 1
        self._cond.notify_all()

    def _known(self, group: int, rank: int) -> tuple[int, int]:
        key = (group, rank)
        if rank not in self._members.get(group, {}):
            raise quorum.QuorumError("NOT_FOUND", f"group {group} rank {rank} has not joined")
        return key

    def _check_member(self, group: int, rank: int, incarnation: str) -> tuple[int, int]:
        """Refuse calls from failed, stale or unknown members (lock held); returns the key."""
        key = (group, rank)
        known = self._incarnations.get(group)
        if incarnation and known is not None and known != incarnation:
            raise quorum.QuorumError("FAILED_PRECONDITION",
                                     f"group {group} rank {rank}: a newer start of group {group} joined; "
                                     "this process is stale and must stop")
        if key in self._failed:
            raise quorum.QuorumError(
                "FAILED_PRECONDITION",
                f"group {group} rank {rank} was marked failed after {self._failed[key]:.1f}s without "
                f"a message (heartbeat_timeout_s={self.heartbeat_timeout_s:g}); join again to continue")
        if group in self._group_failed:
            raise quorum.QuorumError("FAILED_PRECONDITION",
                                     f"group {group} was declared failed ({self._group_failed[group]}); "
                                     "join again to heal")
        return self._known(group, rank)

    def heartbeat(self, req: HeartbeatRequest) -> int:
        """Record that a member is alive at ``step``; returns the epoch. A member of a failed group
        is refused with FAILED_PRECONDITION until it joins again; an unknown one (e.g. after a
        coordinator restart) with NOT_FOUND, which tells it to join again."""
        with self._cond:
            self._check_open()
            self._sweep()
            key = self._check_member(req.group, req.rank, req.incarnation)
            self._last_heard[key] = self._clock()
            self._steps[key] = req.step
            return self._epoch_locked()

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
        if group not in self._members and group not in self._incarnations:
            raise quorum.QuorumError("NOT_FOUND", f"group {group} has no joined rank")

    # --- rounds: quorum per exchange, commit vote, healing ----------------------------------

    def quorum(self, req: QuorumRequest, *, deadline: float,
               active: Callable[[], bool] = lambda: True) -> QuorumResponse:
        """Wait until the quorum this rank's exchange runs in is decided (see ``rounds.decide``);
        a healer (exchange -1) waits for the next quorum that forms. Raises QuorumError:
        DEADLINE_EXCEEDED naming the groups still awaited (the caller asks again),
        FAILED_PRECONDITION for a failed or stale member."""
        key = (req.group, req.rank, req.exchange)  # a rank may ask for several exchanges at once
        with self._cond:
            self._check_open()
            self._sweep()
            self._check_member(req.group, req.rank, req.incarnation)
            self._last_heard[(req.group, req.rank)] = self._clock()
            if not self._started:
                raise quorum.QuorumError("FAILED_PRECONDITION", "the job has not started: join first")
            if req.group in self._healing and req.exchange != rounds.HEAL:
                raise quorum.QuorumError("FAILED_PRECONDITION",
                                         f"group {req.group} joined while the job ran: it must heal first")
            self._asks.setdefault(req.exchange, {}).setdefault(req.group, {})[req.rank] = req
            if req.rank == 0 and req.exchange >= 0:
                self._asked_exchange[req.group] = req.exchange
                self._first_ask.setdefault(req.exchange, self._clock())
                while len(self._first_ask) > MAX_ROUNDS_KEPT:
                    del self._first_ask[next(iter(self._first_ask))]
            self._answers.pop(key, None)
            self._decide_quorums()
            try:
                while key not in self._answers:
                    self._check_open()
                    remaining = deadline - self._clock()
                    if remaining <= 0 or not active():
                        raise quorum.QuorumError(
                            "DEADLINE_EXCEEDED" if remaining <= 0 else "CANCELLED",
                            f"quorum for exchange {req.exchange}: still waiting for "
                            f"{self._awaited(req.exchange)}")
                    self._cond.wait(min(remaining, _POLL_S))
                    self._sweep()
                    self._decide_quorums()
            except quorum.QuorumError:
                self._asks.get(req.exchange, {}).get(req.group, {}).pop(req.rank, None)
                raise
            return self._response(req.group, self._answers.pop(key))

    def _awaited(self, exchange: int) -> str:
        asked = set(self._asks.get(exchange, {}))
        live = sorted(g for g in self._live() if g not in asked)
        if live:
            return f"groups {live} to ask"
        return f"at least {self.min_groups} groups (min_groups)"

    def _live(self) -> set[int]:
        """Groups that count in quorums: joined, not failed, not healing, not finished."""
        return {g for g in self._members if self._complete(g) and g not in self._group_failed
                and g not in self._healing and g not in self._summaries}

    def _group_asks(self, exchange: int) -> dict[int, rounds.Ask]:
        """Groups every rank of which asked for ``exchange``, as rank 0 put it."""
        out = {}
        for g, by_rank in self._asks.get(exchange, {}).items():
            if self._complete(g) and len(by_rank) == self._sizes[g] and 0 in by_rank:
                a = by_rank[0]
                out[g] = rounds.Ask(a.exchange, a.tag, a.numel, a.weight, a.state_hash, a.delta_norm, a.healable)
        return out

    def _decide_quorums(self) -> None:
        """Hand out every quorum that can be decided now (lock held)."""
        heal_asks = self._group_asks(rounds.HEAL)
        live = self._live()
        if len(live) < self.expected_groups and self._clock() < self._rejoin_grace_until:
            return
        if heal_asks and self._summaries and not live:  # the others finished: nobody trains on
            for g in heal_asks:
                self._answer(g, self._asks[rounds.HEAL].pop(g), rounds.HEAL, ("finished", None))
            return
        for exchange in sorted(x for x in self._asks if x >= 0):
            asks = self._group_asks(exchange)
            if not asks:
                continue
            latest = self._latest.get(exchange)
            if latest is not None:
                decided = self._decisions.get(latest)
                if decided is None:
                    continue  # its last attempt is still being voted on
                if decided[0]:
                    for g in asks:
                        self._evict(g, exchange, f"exchange {exchange} was already committed without it")
                    continue
            attempt = sum(1 for q, _ in self._quorums.values() if q.exchange == exchange)
            if latest is None:
                # a healer in an earlier exchange still being voted on joins this one if that commits
                awaited = live | {g for q, _ in self._quorums.values() if q.id not in self._decisions
                                  and q.exchange < exchange for g in q.healers}
                extra = {g: a for g, a in heal_asks.items()}
            else:
                awaited = live & set(self._quorums[latest][0].groups)
                extra = {}
            rejected = {g: why for g, a in asks.items()
                        if (why := rounds.screen(a.delta_norm, self._norms.get(g, []), self.outlier_factor))}
            q = rounds.decide({**asks, **extra}, awaited, next_exchange=exchange, min_groups=self.min_groups,
                              attempt=attempt, quorum_id=f"{self.boot}-{exchange}-{attempt}", rejected=rejected)
            if q is None:
                continue
            members = {g: tuple(self._members[g][r] for r in range(self._sizes[g])) for g in q.groups}
            meta = {"members": members, "sizes": {g: self._sizes[g] for g in q.groups},
                    "incarnations": {g: self._incarnations[g] for g in q.groups},
                    "norms": {g: asks[g].delta_norm for g in q.groups if g in asks}, "orphan": False,
                    "decided_at": self._clock(), "stop": self._stop_reason is not None,
                    "training": all(a.healable for g, a in asks.items() if g in q.groups)}
            self._remember_quorum(q, meta)
            for g in q.groups:
                source = rounds.HEAL if g in q.healers else exchange
                self._answer(g, self._asks[source].pop(g), source, ("quorum", q.id))
            for g, why in q.rejected.items():
                self._counts["rejected"] += 1
                self._event("rejected", group=g, exchange=exchange, reason=why)
            for g, why in q.evicted.items():
                self._evict(g, exchange, why)
            heal_asks = {g: a for g, a in heal_asks.items() if g not in q.healers}

    def _answer(self, g: int, by_rank: dict[int, QuorumRequest], exchange: int, answer: tuple[str, Any]) -> None:
        for r in by_rank:
            self._answers[(g, r, exchange)] = answer
        self._cond.notify_all()

    def _evict(self, g: int, exchange: int, why: str) -> None:
        by_rank = self._asks.get(exchange, {}).pop(g, {})
        self._answer(g, by_rank, exchange, ("evicted", why))
        self._counts["evicted"] += 1
        self._event("evicted", group=g, exchange=exchange, reason=why)
        self._fail_group(g, f"evicted: {why}")

    def _remember_quorum(self, q: rounds.Quorum, meta: dict[str, Any]) -> None:
        self._quorums[q.id] = (q, meta)
        self._latest[q.exchange] = q.id
        self._latest.move_to_end(q.exchange)
        while len(self._quorums) > MAX_ROUNDS_KEPT:
            old, _ = self._quorums.popitem(last=False)
            self._votes.pop(old, None)
            self._decisions.pop(old, None)
            for k in [k for k in self._offers if k[0] == old]:
                del self._offers[k]
        while len(self._latest) > MAX_ROUNDS_KEPT:
            self._latest.popitem(last=False)

    def _response(self, g: int, answer: tuple[str, Any]) -> QuorumResponse:
        kind, value = answer
        stop = self._stop_reason is not None
        if kind == "evicted":
            return QuorumResponse(id="", exchange=-1, attempt=0, tag="", numel=0, members={}, weights={},
                                  evicted=value, stop=stop, finished=True)
        if kind == "finished":
            return QuorumResponse(id="", exchange=-1, attempt=0, tag="", numel=0, members={}, weights={},
                                  stop=stop, finished=True)
        q, meta = self._quorums[value]  # stop is frozen when the quorum forms: every member stops at it
        return QuorumResponse(id=q.id, exchange=q.exchange, attempt=q.attempt, tag=q.tag, numel=q.numel,
                              members=dict(meta["members"]), weights=dict(q.weights), healers=q.healers,
                              donor=q.donor, rejected=dict(q.rejected), state_hash=q.state_hash,
                              stop=meta.get("stop", False))

    def commit(self, req: CommitRequest, *, deadline: float,
               active: Callable[[], bool] = lambda: True) -> CommitResponse:
        """Record this rank's vote and wait for the quorum's decision (``rounds.commit_outcome``).
        A vote on a quorum of a previous coordinator (it restarted) is decided from the votes and
        from what the members ask for next."""
        with self._cond:
            self._check_open()
            self._sweep()
            key = self._check_member(req.group, req.rank, req.incarnation)
            self._last_heard[key] = self._clock()
            if req.quorum_id not in self._quorums:
                if req.quorum_id.startswith(f"{self.boot}-"):
                    raise quorum.QuorumError("NOT_FOUND", f"quorum {req.quorum_id} is unknown or too old")
                if req.group not in req.groups:
                    raise quorum.QuorumError("INVALID_ARGUMENT", f"group {req.group} votes on quorum "
                                             f"{req.quorum_id} of groups {sorted(req.groups)} without being in it")
                made = self._orphans_by_group.get(req.group, 0)
                if made >= MAX_ORPHANS_PER_GROUP:
                    raise quorum.QuorumError("FAILED_PRECONDITION", f"group {req.group} already voted on "
                                             f"{made} quorums of a previous coordinator; refusing {req.quorum_id}")
                self._orphans_by_group[req.group] = made + 1
                q = rounds.Quorum(id=req.quorum_id, exchange=req.exchange, attempt=0, tag="", numel=0,
                                  groups=tuple(sorted(req.groups)), weights={g: 1.0 for g in req.groups})
                self._remember_quorum(q, {"members": {}, "sizes": {}, "incarnations": {}, "norms": {},
                                          "orphan": True, "decided_at": self._clock()})
            q, meta = self._quorums[req.quorum_id]
            if req.group not in q.groups:
                raise quorum.QuorumError("INVALID_ARGUMENT", f"group {req.group} is not in quorum {q.id}")
            self._votes.setdefault(q.id, {})[key] = (req.ok, req.reason)
            while q.id not in self._decisions:
                self._decide_vote(q, meta)
                if q.id in self._decisions:
                    break
                remaining = deadline - self._clock()
                if remaining <= 0 or not active():
                    raise quorum.QuorumError("DEADLINE_EXCEEDED" if remaining <= 0 else "CANCELLED",
                                             f"vote on {q.id}: not every member has voted yet")
                self._cond.wait(min(remaining, _POLL_S))
                self._check_open()
                self._sweep()
            committed, why = self._decisions[q.id]
            return CommitResponse(committed=committed, reason=why)

    def _decide_vote(self, q: rounds.Quorum, meta: dict[str, Any]) -> None:
        failed = {}
        for g in q.groups:
            if g in self._group_failed:
                failed[g] = self._group_failed[g]
            elif meta["incarnations"].get(g, self._incarnations.get(g)) != self._incarnations.get(g):
                failed[g] = "it started again"
            elif meta["orphan"] and not self._complete(g) and \
                    self._clock() - self._complete_at > self.heartbeat_timeout_s:
                failed[g] = "it did not rejoin after the coordinator restarted"
        sizes = meta["sizes"] or {g: self._sizes.get(g, 1) for g in q.groups}
        since = {g: self._asked_exchange[g] for g in q.groups if g in self._asked_exchange} if meta["orphan"] else None
        votes = self._votes.get(q.id, {})
        outcome = rounds.commit_outcome(q, sizes, votes, failed, since)
        first_vote = meta.setdefault("first_vote", self._clock())
        if outcome is None and self._clock() - first_vote > self.vote_timeout_s:
            silent = sorted({g for g in q.groups for r in range(sizes[g]) if (g, r) not in votes})
            outcome = (False, f"groups {silent} did not vote within {self.vote_timeout_s:g}s of the first vote")
        if outcome is None:
            return
        committed, why = outcome
        self._decisions[q.id] = outcome
        if committed:
            self._counts["committed"] += 1
            self._counts["committed_training"] += bool(meta.get("training", True))
            members = len(q.groups) - len(q.healers)
            asked = self._first_ask.pop(q.exchange, None)
            if asked is not None and (q.attempt > 0 or members < self._last_members):
                # an exchange a failure disturbed: retried, or run by fewer groups than the last one
                self._event("stall", exchange=q.exchange, seconds=round(self._clock() - asked, 4),
                            attempts=q.attempt + 1, groups=len(q.groups))
            self._last_members = members
            for g in q.healers:
                if g in self._healing:
                    self._healing.discard(g)
                    self._counts["heals"] += 1
                    self._event("healed", group=g, exchange=q.exchange, quorum=q.id,
                                committed=self._counts["committed"])
            for g, norm in meta["norms"].items():
                if g not in q.rejected and q.weights.get(g, 0) > 0:
                    history = self._norms.setdefault(g, [])
                    history.append(norm)
                    del history[:-NORM_HISTORY]
        else:
            self._counts["rolled_back"] += 1
            self._event("rolled_back", exchange=q.exchange, quorum=q.id, reason=why)
        self._cond.notify_all()

    def offer(self, req: StateOffer) -> int:
        """A donor rank announces the state it serves to one healer rank; returns the epoch."""
        with self._cond:
            self._check_open()
            if req.quorum_id not in self._quorums:
                raise quorum.QuorumError("NOT_FOUND", f"quorum {req.quorum_id} is unknown or too old")
            q, _ = self._quorums[req.quorum_id]
            if req.donor_group != q.donor or req.healer_group not in q.healers:
                raise quorum.QuorumError("INVALID_ARGUMENT",
                                         f"quorum {q.id}: donor is group {q.donor}, healers {list(q.healers)}")
            self._offers[(req.quorum_id, req.healer_group, req.healer_rank)] = req
            self._cond.notify_all()
            return self._epoch_locked()

    def wait_offer(self, req: OfferQuery, *, deadline: float,
                   active: Callable[[], bool] = lambda: True) -> StateOffer:
        """Wait for the donor's offer to this healer rank; ABORTED if the quorum was rolled back or
        its donor failed first (heal again with the next quorum)."""
        key = (req.quorum_id, req.healer_group, req.healer_rank)
        with self._cond:
            while key not in self._offers:
                self._check_open()
                self._sweep()
                entry = self._quorums.get(req.quorum_id)
                if entry is None:
                    raise quorum.QuorumError("NOT_FOUND", f"quorum {req.quorum_id} is unknown or too old")
                q, _ = entry
                decided = self._decisions.get(q.id)
                if q.donor in self._group_failed or (decided is not None and not decided[0]):
                    raise quorum.QuorumError("ABORTED", f"quorum {q.id} failed before its donor offered: "
                                             f"{self._group_failed.get(q.donor) or decided[1]}")  # type: ignore[index]
                remaining = deadline - self._clock()
                if remaining <= 0 or not active():
                    raise quorum.QuorumError("DEADLINE_EXCEEDED", f"no state offer for quorum {q.id} yet")
                self._cond.wait(min(remaining, _POLL_S))
            return self._offers[key]

    def request_stop(self, reason: str) -> None:
        """Ask every group to checkpoint and stop after its next exchange (quorums say ``stop``)."""
        with self._cond:
            if self._stop_reason is None:
                self._stop_reason = reason or "stop requested"
                self._event("stop", reason=self._stop_reason)
            self._cond.notify_all()

    def _event(self, kind: str, **fields: Any) -> None:
        self._event_seq += 1
        self._events[self._event_seq] = {"seq": self._event_seq, "kind": kind,
                                         "at_s": round(self._clock() - self._started_at, 3), **fields}
        while len(self._events) > MAX_EVENTS_KEPT:
            self._events.popitem(last=False)

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
                "rounds_state": {
                    "boot": self.boot, "started": self._started, "min_groups": self.min_groups,
                    "heartbeat_timeout_s": self.heartbeat_timeout_s, **self._counts,
                    "live_groups": sorted(self._live()), "healing_groups": sorted(self._healing),
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
        return self._epoch
