"""The state of the rounds: every exchange asks for a quorum (``quorum``), every rank votes on it
(``commit``), healers wait for their donor's state offer (``offer``/``wait_offer``), and a stop
request reaches every group through the quorums (``request_stop``).

``rounds.py`` holds the rules; this class keeps the asks, quorums, votes, decisions and offers
and applies the rules under the lock of :class:`~diloco.coordinator.liveness.Liveness`, whose
membership and liveness it builds on (a failed group's waiting requests are answered here).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from typing import Any, Callable

from . import quorum, rounds
from .liveness import _POLL_S, Liveness
from .messages import CommitRequest, CommitResponse, OfferQuery, QuorumRequest, QuorumResponse, StateOffer

MAX_ROUNDS_KEPT = 1024  # quorums, round hashes and divergences kept, oldest dropped first
NORM_HISTORY = 8  # accepted contribution norms kept per group for the outlier screen
# votes on quorums of a previous coordinator (it restarted) that one group may make us remember: an
# honest group has at most a few exchanges in flight; without a bound, a group could push the
# other groups' live quorums out of memory with votes on made-up quorum ids
MAX_ORPHANS_PER_GROUP = 16


class RoundState(Liveness):
    """Quorums, votes and state offers of the job's exchanges, on top of its membership."""

    def __init__(self, expected_groups: int, *, join_timeout_s: float, heartbeat_timeout_s: float,
                 max_group_size: int, min_groups: int, outlier_factor: float,
                 clock: Callable[[], float], quorum_grace_s: float = 0.0) -> None:
        super().__init__(expected_groups, join_timeout_s=join_timeout_s,
                         heartbeat_timeout_s=heartbeat_timeout_s, max_group_size=max_group_size, clock=clock)
        if not 1 <= min_groups <= expected_groups:
            raise ValueError(f"min_groups must be in [1, {expected_groups}], got {min_groups}")
        if outlier_factor < 0:
            raise ValueError(f"outlier_factor must be >= 0 (0: off), got {outlier_factor}")
        if not 0 <= quorum_grace_s < float("inf"):
            raise ValueError(f"quorum_grace_s must be >= 0 seconds (0: off), got {quorum_grace_s}")
        self.min_groups = min_groups
        self.outlier_factor = outlier_factor
        # with it > 0, an exchange's quorum forms this long after its first ask with the groups that
        # asked by then (rounds.decide); the live groups left out are failed when it commits
        self.quorum_grace_s = quorum_grace_s
        self.boot = secrets.token_hex(4)  # names this coordinator's quorums apart from a predecessor's
        # a backstop: a member alive (heartbeating) but silent this long after a quorum's first vote
        # is stuck, and the round rolls back (members' rings end together; a healer's state transfer
        # runs after its vote, so no vote waits for it)
        self.vote_timeout_s = join_timeout_s
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
        self._grace_from: dict[int, float] = {}  # exchange -> first ask of its attempt being formed
        self._healed_at: dict[int, int] = {}  # group -> exchange it healed in, until it asks for a later one
        self._last_members = 0  # groups of the last committed quorum, healers included
        self._stop_reason: str | None = None

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
            if req.exchange == rounds.HEAL and req.group not in self._healing:
                # a member asks to heal again (its state transfer failed after its healing exchange
                # committed): it holds no state, so no quorum waits for it as a member
                self._healing.add(req.group)
                self._event("joined", group=req.group, committed=self._counts["committed"], again=True)
                self._note_job_lost()
            self._asks.setdefault(req.exchange, {}).setdefault(req.group, {})[req.rank] = req
            if req.rank == 0 and req.exchange >= 0:
                self._asked_exchange[req.group] = req.exchange
                if self._healed_at.get(req.group, req.exchange) < req.exchange:
                    del self._healed_at[req.group]
                self._first_ask.setdefault(req.exchange, self._clock())
                while len(self._first_ask) > MAX_ROUNDS_KEPT:
                    del self._first_ask[next(iter(self._first_ask))]
            latest = self._latest.get(req.exchange)
            if req.exchange >= 0 and (latest is None or latest in self._decisions):
                # the grace window of the attempt to be formed starts at its first ask (a late
                # ask during an attempt's vote does not start the next attempt's window)
                self._grace_from.setdefault(req.exchange, self._clock())
                while len(self._grace_from) > MAX_ROUNDS_KEPT:
                    del self._grace_from[next(iter(self._grace_from))]
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
                    self._cond.wait(min(remaining, _POLL_S, self._grace_left(req.exchange)))
                    self._sweep()
                    self._decide_quorums()
            except quorum.QuorumError:
                self._asks.get(req.exchange, {}).get(req.group, {}).pop(req.rank, None)
                raise
            return self._response(req.group, self._answers.pop(key))

    def _silence(self) -> dict[int, float]:
        """Group -> seconds since its most silent rank was last heard from (lock held)."""
        now, out = self._clock(), {}
        for (g, _), t in self._last_heard.items():
            out[g] = max(out.get(g, 0.0), now - t)
        return out

    def _grace_left(self, exchange: int) -> float:
        """Seconds until the grace window of ``exchange``'s next attempt ends (a wake-up time;
        infinite without a window or before its first ask; at least 1 ms)."""
        start = self._grace_from.get(exchange)
        if not self.quorum_grace_s or start is None:
            return float("inf")
        return max(start + self.quorum_grace_s - self._clock(), 0.001)

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
                out[g] = rounds.Ask(a.exchange, a.tag, a.numel, a.weight, a.state_hash, a.delta_norm, a.healable,
                                    a.setting)
        return out

    def _decide_quorums(self) -> None:
        """Hand out every quorum that can be decided now (lock held)."""
        heal_asks = self._group_asks(rounds.HEAL)
        if self.job_lost is not None:  # no donor will ever come: healers learn so at once
            for g in heal_asks:
                self._answer(g, self._asks[rounds.HEAL].pop(g), rounds.HEAL, ("evicted", self.job_lost))
            return
        live = self._live()
        if len(live) < self.expected_groups and self._clock() < self._rejoin_grace_until:
            return
        if heal_asks and self._summaries and not live:  # the others finished: nobody trains on
            for g in heal_asks:
                self._answer(g, self._asks[rounds.HEAL].pop(g), rounds.HEAL, ("finished", None))
            return
        if heal_asks and not live and self.restart_when_state_lost:  # no donor will ever come
            self.state_lost = (f"every group was lost (groups {sorted(heal_asks)} restarted and none holds the "
                               "job's state): restart, and resume from the job checkpoints")
            self._event("state_lost", groups=sorted(heal_asks))
            for g in list(heal_asks):
                self._evict(g, rounds.HEAL, self.state_lost)
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
                    self._grace_from.pop(exchange, None)
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
            start = self._grace_from.get(exchange)
            q = rounds.decide({**asks, **extra}, awaited, next_exchange=exchange, min_groups=self.min_groups,
                              attempt=attempt, quorum_id=f"{self.boot}-{exchange}-{attempt}", rejected=rejected,
                              waited_s=None if start is None else self._clock() - start,
                              grace_s=self.quorum_grace_s,
                              patient=rounds.patient_groups(self._healed_at, exchange, self._silence(),
                                                            2 * self.heartbeat_timeout_s / 5))
            if q is None:
                continue
            self._grace_from.pop(exchange, None)
            if q.left_out:
                self._event("left_out", exchange=exchange, groups=list(q.left_out), quorum=q.id,
                            waited_s=round(self._clock() - start, 4) if start is not None else None)
            members = {g: tuple(self._members[g][r] for r in range(self._sizes[g])) for g in q.groups}
            if q.setting:
                self.latest_setting = q.setting
            meta = {"setting": q.setting, "members": members, "sizes": {g: self._sizes[g] for g in q.groups},
                    "incarnations": {g: self._incarnations[g] for g in q.groups},
                    "norms": {g: asks[g].delta_norm for g in q.groups if g in asks}, "orphan": False,
                    "decided_at": self._clock(), "stop": self._stop_reason is not None,
                    "training": all(a.healable for g, a in asks.items() if g in q.groups),
                    "left_out": {g: self._incarnations.get(g) for g in q.left_out}}
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
                              stop=meta.get("stop", False), setting=meta.get("setting", ""))

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

    def quorum_lost(self, quorum_id: str, group: int) -> str:
        """Why quorum ``quorum_id`` of member ``group`` can no longer commit: a member failed or
        started again since it formed, or it was rolled back; "" while it can (or when it is
        unknown here, or ``group`` is not its member). A member running its rings learns this
        with its heartbeat and aborts them at once, instead of waiting for data from a group that
        is gone until the rings' deadline."""
        with self._cond:
            known = self._quorums.get(quorum_id) if quorum_id else None
            if known is None or group not in known[0].groups:
                return ""
            q, meta = known
            decided = self._decisions.get(q.id)
            if decided is not None:
                return "" if decided[0] else f"quorum {q.id} was rolled back: {decided[1]}"
            failed = self._failed_members(q, meta)
            return "; ".join(f"group {g} of quorum {q.id} failed: {why}" for g, why in sorted(failed.items()))

    def _failed_members(self, q: rounds.Quorum, meta: dict[str, Any]) -> dict[int, str]:
        """The members of ``q`` that failed since it formed, and why (lock held)."""
        failed = {}
        for g in q.groups:
            if g in self._group_failed:
                failed[g] = self._group_failed[g]
            elif meta["incarnations"].get(g, self._incarnations.get(g)) != self._incarnations.get(g):
                failed[g] = "it started again"
            elif meta["orphan"] and not self._complete(g) and \
                    self._clock() - self._complete_at > self.heartbeat_timeout_s:
                failed[g] = "it did not rejoin after the coordinator restarted"
        return failed

    def _decide_vote(self, q: rounds.Quorum, meta: dict[str, Any]) -> None:
        failed = self._failed_members(q, meta)
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
            members = len(q.groups)  # healers too (the workers' FaultStats count alike): a group lost
            asked = self._first_ask.pop(q.exchange, None)  # just after it healed disturbs the next one
            if asked is not None and (q.attempt > 0 or members < self._last_members):
                # an exchange a failure disturbed: retried, or run by fewer groups than the last one
                self._event("stall", exchange=q.exchange, seconds=round(self._clock() - asked, 4),
                            attempts=q.attempt + 1, groups=len(q.groups))
            self._last_members = members
            for g, incarnation in meta.get("left_out", {}).items():  # out of step now: it lost this round's
                if self._incarnations.get(g) != incarnation or g in self._healing:  # work, and heals
                    continue  # it started again meanwhile: that start heals already
                self._fail_group(g, f"missed exchange {q.exchange}: its quorum formed without this group once "
                                    f"the {self.quorum_grace_s:g}s grace window (--quorum-grace) ended; it "
                                    "heals into a later exchange")
            for g in q.healers:
                if g in self._healing:
                    self._healing.discard(g)
                    self._healed_at[g] = q.exchange
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

    def _release_asks(self, g: int, reason: str) -> None:
        self._healed_at.pop(g, None)
        for exchange, asks in self._asks.items():
            for r in asks.pop(g, {}):
                self._answers[(g, r, exchange)] = ("evicted", reason)
