"""The state of the rounds: every exchange asks for a quorum (``quorum``), which forms, rolls back
on a disagreement, or halts the job; a group the grace window left out catches up when it asks; a
stop request reaches every group through the quorums (``request_stop``). The votes on a quorum and
what a commit changes are ``vote_state.py``'s.

``rounds.py`` holds the rules; this class keeps the asks, quorums, votes, decisions and offers
and applies the rules under the lock of :class:`~diloco.coordinator.joins.Joins` (the membership), on
:class:`~diloco.coordinator.liveness.Liveness` (who is alive; a failed group's waiting requests are answered
here) and :class:`~diloco.coordinator.grace_window.GraceWindow` (how long an exchange waits for late groups).
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from typing import Any, Callable

from . import quorum, rounds
from .ask_book import Answer, AskBook
from .grace_window import GraceWindow
from .joins import _POLL_S
from .messages import QuorumRequest, QuorumResponse, StateOffer

log = logging.getLogger(__name__)

MAX_ROUNDS_KEPT = 1024  # quorums, round hashes and divergences kept, oldest dropped first
NORM_HISTORY = 8  # accepted contribution norms kept per group for the outlier screen
# votes on quorums of a previous coordinator (it restarted) that one group may make us remember: an
# honest group has at most a few exchanges in flight; without a bound, a group could push the
# other groups' live quorums out of memory with votes on made-up quorum ids
MAX_ORPHANS_PER_GROUP = 16
#: exchanges a live group may be behind (left out of by the grace window, committed without it) and
#: still catch up in place; one further behind is out of step: it restarts and heals
MAX_BEHIND = 8


class RoundState(GraceWindow):
    """The asks and quorums of the job's exchanges, on top of its membership; the state their votes
    and offers use too (``VoteState`` adds the methods)."""

    def __init__(self, expected_groups: int, *, join_timeout_s: float, heartbeat_timeout_s: float,
                 max_group_size: int, min_groups: int, outlier_factor: float,
                 clock: Callable[[], float], quorum_grace_s: float = 0.0) -> None:
        super().__init__(expected_groups, join_timeout_s=join_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
                         max_group_size=max_group_size, clock=clock, quorum_grace_s=quorum_grace_s)
        if not 1 <= min_groups <= expected_groups:
            raise ValueError(f"min_groups must be in [1, {expected_groups}], got {min_groups}")
        if outlier_factor < 0:
            raise ValueError(f"outlier_factor must be >= 0 (0: off), got {outlier_factor}")
        self.min_groups = min_groups
        self.outlier_factor = outlier_factor
        self.boot = secrets.token_hex(4)  # names this coordinator's quorums apart from a predecessor's
        # a backstop: a member alive (heartbeating) but silent this long after a quorum's first vote
        # is stuck, and the round rolls back (members' rings end together; a healer's state transfer
        # runs after its vote, so no vote waits for it); a live group that has not asked for an
        # exchange this long after the first group did is stuck too, and is failed
        self.vote_timeout_s = join_timeout_s
        self._book = AskBook()  # the waiting quorum requests and their answers
        self._quorums: OrderedDict[str, tuple[rounds.Quorum, dict[str, Any]]] = OrderedDict()
        self._orphans_by_group: dict[int, int] = {}  # group -> orphan quorums it made us remember
        self._latest: OrderedDict[int, str] = OrderedDict()  # exchange -> id of its latest quorum
        self._votes: dict[str, dict[tuple[int, int], tuple[bool, str]]] = {}
        self._decisions: dict[str, tuple[bool, str]] = {}
        self._offers: dict[tuple[str, int, int], StateOffer] = {}
        self._norms: dict[int, list[float]] = {}
        self._asked_exchange: dict[int, int] = {}  # group -> latest exchange its rank 0 asked for
        self._first_ask: dict[int, float] = {}  # exchange -> when its first quorum request came
        self._healed_at: dict[int, int] = {}  # group -> exchange it healed in, until it asks for a later one
        #: groups told the job finished before they could heal: their summaries hold no model
        self.joined_late: set[int] = set()
        self._last_members = 0  # groups of the last committed quorum, healers included
        self._stop_reason: str | None = None
        #: the job's committed position: its lowest exchange not yet committed (None after a restart,
        #: until an exchange commits here); asks beyond it + rounds.MAX_EXCHANGES_AHEAD are refused
        self.frontier: int | None = None
        self._committed_above: set[int] = set()  # committed exchanges above the frontier
        self._disagreements: dict[int, int] = {}  # exchange -> ties in a row (rounds.Disagreement)
        self._vetoes: dict[int, int] = {}  # group -> attempts in a row its votes alone rolled back
        #: group -> {exchange: id of the quorum that committed it without the group}: a live group
        #: the grace window left out, which takes that exchange's mean at weight 0 when it asks (catches up)
        self._behind: dict[int, dict[int, str]] = {}
        self._last_ask: dict[int, tuple[str, int]] = {}  # group -> (incarnation, latest exchange any rank asked for)
        #: (quorum id, left-out group) -> {member group: SHA-256 of the committed mean it landed}: a
        #: catch-up takes the donor's mean only once a majority of the members vouch for its digest
        self._witnesses: dict[tuple[str, int], dict[int, str]] = {}
        self._splits = 0  # rolled-back attempts in a row whose votes split evenly (rounds.vote_sides)

    # --- rounds: quorum per exchange, healing, catching up ------------------------------------

    def quorum(self, req: QuorumRequest, *, deadline: float,
               active: Callable[[], bool] = lambda: True) -> QuorumResponse:
        """Wait until the quorum this rank's exchange runs in is decided (see ``rounds.decide``);
        a healer (exchange -1) waits for the next quorum that forms. Raises QuorumError:
        DEADLINE_EXCEEDED naming the groups still awaited (the caller asks again),
        FAILED_PRECONDITION for a failed or stale member, INVALID_ARGUMENT for an exchange beyond
        the job's reach or a second, different request for the same rank and exchange."""
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
            self._check_in_step(req)
            if req.exchange == rounds.HEAL and req.group not in self._healing:
                # a member asks to heal again (its state transfer failed after its healing exchange
                # committed): it holds no state, so no quorum waits for it as a member
                self._healing.add(req.group)
                self._behind.pop(req.group, None)
                self._event("joined", group=req.group, committed=self._counts["committed"], again=True)
                self._note_job_lost()
            generation, new = self._book.register(req)
            if new:
                self._note_ask(req)
                self._decide_quorums()
            self._book.enter(key)
            try:
                while (answer := self._book.answered(key, generation)) is None:
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
            finally:
                self._book.leave(key, generation)
            return self._response(req.group, answer)

    def join(self, req, *, deadline: float, active: Callable[[], bool] = lambda: True):
        """``Joins.join``; a member rejoining at ``exchange`` (after our restart) has asked for
        every exchange below it already, as far as the skip rule (``_check_in_step``) goes."""
        membership = super().join(req, deadline=deadline, active=active)
        if req.exchange > 0:
            with self._cond:
                last = self._last_ask.get(req.group)
                if last is None or last[0] != req.incarnation or last[1] < req.exchange - 1:
                    self._last_ask[req.group] = (req.incarnation, req.exchange - 1)
        return membership

    def _check_in_step(self, req: QuorumRequest) -> None:
        """Refuse an ask no honest member makes (lock held): an exchange more than
        ``rounds.MAX_EXCHANGES_AHEAD`` past the job's committed position, or one that skips
        exchanges after this incarnation's last ask (a group asks for its exchanges in order; a
        heal starts it afresh). Its group is out of step: it is failed (restart and heal), so no
        other group waits for it."""
        if req.exchange < 0 or self.frontier is None or req.exchange <= self.frontier:
            return
        why = None
        if req.exchange > self.frontier + rounds.MAX_EXCHANGES_AHEAD:
            why = (f"asked for exchange {req.exchange}, more than {rounds.MAX_EXCHANGES_AHEAD} past the job's next "
                   f"exchange {self.frontier}")
        last = self._last_ask.get(req.group)
        incarnation = self._incarnations.get(req.group, "")  # the group's, whatever the caller says
        if why is None and last is not None and last[0] == incarnation and req.exchange > last[1] + 1:
            why = f"asked for exchange {req.exchange} after exchange {last[1]}: it skipped exchanges"
        if why is not None:
            self._event("out_of_step", group=req.group, rank=req.rank, exchange=req.exchange, reason=why)
            self._fail_group(req.group, f"out of step: {why}")
            raise quorum.QuorumError("FAILED_PRECONDITION", f"group {req.group} rank {req.rank} {why}: "
                                     "out of step, it restarts and heals")

    def _note_ask(self, req: QuorumRequest) -> None:
        """A new ask: when its exchange was first asked for, and the group's latest exchange."""
        if req.exchange == rounds.HEAL:
            self._last_ask.pop(req.group, None)  # a heal starts its exchanges afresh
        if req.exchange >= 0:
            last, incarnation = self._last_ask.get(req.group), self._incarnations.get(req.group, "")
            if last is None or last[0] != incarnation or last[1] < req.exchange:
                self._last_ask[req.group] = (incarnation, req.exchange)
        if req.rank == 0 and req.exchange >= 0:
            self._asked_exchange[req.group] = req.exchange
            if self._healed_at.get(req.group, req.exchange) < req.exchange:
                del self._healed_at[req.group]
            self._first_ask.setdefault(req.exchange, self._clock())
            while len(self._first_ask) > MAX_ROUNDS_KEPT:
                del self._first_ask[next(iter(self._first_ask))]

    def _form(self) -> None:
        super()._form()
        self.frontier = 0  # a job that starts here starts at its first exchange

    def _awaited(self, exchange: int) -> str:
        asked = set(self._book.asks.get(exchange, {}))
        live = sorted(g for g in self._live() if g not in asked)
        if live:
            return f"groups {live} to ask"
        return f"at least {self.min_groups} groups (min_groups), a majority of the live ones"

    def _live(self) -> set[int]:
        """Groups that count in quorums: joined, not failed, not healing, not finished (nor told so)."""
        return {g for g in self._members if self._complete(g) and g not in self._group_failed
                and g not in self._healing and g not in self._summaries and g not in self.joined_late}

    def _group_asks(self, exchange: int) -> dict[int, rounds.Ask]:
        """Groups every rank of which asked for ``exchange``, as rank 0 put it."""
        out = {}
        for g, by_rank in self._book.asks.get(exchange, {}).items():
            if self._complete(g) and len(by_rank) == self._sizes[g] and 0 in by_rank:
                a = by_rank[0]
                out[g] = rounds.Ask(a.exchange, a.tag, a.numel, a.weight, a.state_hash, a.delta_norm, a.healable,
                                    a.setting, a.weight_cap, self._sizes[g])
        return out

    def _decide_quorums(self) -> None:
        """Hand out every quorum that can be decided now (lock held)."""
        if self.halted is not None:
            return
        heal_asks = self._group_asks(rounds.HEAL)
        if self.job_lost is not None:  # no donor will ever come: healers learn so at once
            for g in heal_asks:
                self._answer(g, rounds.HEAL, ("evicted", self.job_lost))
            return
        live = self._live()
        if len(live) < self.expected_groups and self._clock() < self._rejoin_grace_until:
            return
        trained = rounds.trained_groups(self._summaries)
        if heal_asks and trained and not live:  # the job's model is final: nobody trains on
            for g in heal_asks:
                if g not in trained:  # a restart after its own end keeps that end's summary
                    self.joined_late.add(g)
                    self._event("joined_late", group=g)
                self._healing.discard(g)  # it heals from nobody: it ends
                self._answer(g, rounds.HEAL, ("finished", None))
            return
        if heal_asks and not live and self.restart_when_state_lost:  # no donor will ever come
            self.state_lost = (f"every group was lost (groups {sorted(heal_asks)} restarted and none holds the "
                               "job's state): restart, and resume from the job checkpoints")
            self._event("state_lost", groups=sorted(heal_asks))
            for g in list(heal_asks):
                self._evict(g, rounds.HEAL, self.state_lost)
            return
        for exchange in [x for x in self._book.exchanges() if x >= 0]:
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
                        self._after_commit(g, exchange, latest, asks[g])
                    self._grace_from.pop(exchange, None)
                    continue
                self._assess_votes(*self._quorums[latest])  # before its next attempt forms
                asks = self._group_asks(exchange)  # without a member just evicted for its votes
                if not asks:
                    continue
            elif self.frontier is not None and exchange < self.frontier:
                for g in asks:
                    self._evict(g, exchange, f"exchange {exchange} was committed long ago")
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
            heard = self._heard()
            training = self._counts["committed_training"] > 0  # before it, start-up skew is no fault
            start = self._majority_asked(exchange, asks, awaited & heard)
            patient = rounds.patient_groups(self._healed_at, exchange, self._silence(), self._heard_limit_s())
            if training and start is not None and self._clock() - start > self.vote_timeout_s:
                for g in sorted(g for g in awaited & live if g not in asks and g not in patient):
                    self._fail_group(g, f"stuck: heard from, but it did not ask for exchange {exchange} within "
                                        f"{self.vote_timeout_s:g}s of a majority of the groups asking")
                awaited, live = awaited - set(self._group_failed), self._live()
            rejected = {g: why for g, a in asks.items()
                        if (why := rounds.screen(a.delta_norm, self._norms.get(g, []), self.outlier_factor))}
            grace = self.quorum_grace_s if training else 0.0
            q = rounds.decide({**asks, **extra}, awaited, next_exchange=exchange, min_groups=self.min_groups,
                              attempt=attempt, quorum_id=f"{self.boot}-{exchange}-{attempt}", rejected=rejected,
                              waited_s=None if start is None else self._clock() - start, grace_s=grace,
                              patient=patient, heartbeating=heard, healing=self._healing & heard)
            if q is None:
                continue
            self._grace_from.pop(exchange, None)
            if isinstance(q, rounds.Disagreement):
                self._disagreed(q, asks)
                continue
            self._form_quorum(q, asks, exchange, start)
            heal_asks = {g: a for g, a in heal_asks.items() if g not in q.healers}

    def _form_quorum(self, q: rounds.Quorum, asks: dict[int, rounds.Ask], exchange: int, start: float | None) -> None:
        """Hand out quorum ``q`` of ``exchange`` to its members (lock held)."""
        self._disagreements.pop(exchange, None)
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
                "left_out": {g: self._incarnations.get(g) for g in q.left_out},
                "left_out_members": {g: tuple(self._members[g][r] for r in range(self._sizes[g])) for g in q.left_out}}
        self._remember_quorum(q, meta)
        for g in q.groups:
            self._answer(g, rounds.HEAL if g in q.healers else exchange, ("quorum", q.id))
        for g, why in q.rejected.items():
            self._counts["rejected"] += 1
            self._event("rejected", group=g, exchange=exchange, reason=why)
        for g, why in q.evicted.items():
            self._evict(g, exchange, why)

    def _disagreed(self, d: rounds.Disagreement, asks: dict[int, rounds.Ask]) -> None:
        """Members that differ with no majority: every asker asks again; the second tie in a row
        on one exchange halts the job (lock held)."""
        count = self._disagreements[d.exchange] = self._disagreements.get(d.exchange, 0) + 1
        while len(self._disagreements) > MAX_ROUNDS_KEPT:
            del self._disagreements[next(iter(self._disagreements))]
        self._event("disagreement", exchange=d.exchange, what=d.what, values=dict(d.values), count=count)
        if count >= rounds.DISAGREEMENT_LIMIT:
            self._halt(f"{d.message()}, {count} attempts in a row; the coordinator cannot tell which group is "
                       "right from their word alone: compare the groups' configurations, versions and logs, then "
                       "resume from a checkpoint")
            return
        log.warning("exchange %d: %s; every group asks again", d.exchange, d.message())
        for g in asks:
            self._answer(g, d.exchange, ("disagreement", d.message()))

    def _halt(self, reason: str) -> None:
        """Stop the job for good (lock held): every waiting call and every later one is refused with
        ``reason`` (``Joins.halted``)."""
        if self.halted is not None:
            return
        self.halted = reason
        self._event("halted", reason=reason)
        log.error("the job halted: %s", reason)
        for exchange in self._book.exchanges():
            for g in list(self._book.asks.get(exchange, {})):
                self._answer(g, exchange, ("halted", reason))
        self._cond.notify_all()

    def _after_commit(self, g: int, exchange: int, quorum_id: str, ask: rounds.Ask) -> None:
        """Group ``g`` asks for ``exchange``, which committed (lock held): a live group the grace
        window left out of it catches up (takes its mean at weight 0); any other is out of step."""
        q, _ = self._quorums[quorum_id]
        if self._behind.get(g, {}).get(exchange) != quorum_id:
            self._evict(g, exchange, f"exchange {exchange} was already committed without it")
            return
        del self._behind[g][exchange]
        if q.state_hash and ask.state_hash and ask.state_hash != q.state_hash:
            self._evict(g, exchange, f"its global state hash {ask.state_hash} differs from the one exchange "
                                     f"{exchange} started from ({q.state_hash}), so it cannot catch up")
            return
        self._counts["caught_up"] += 1
        self._event("catch_up", group=g, exchange=exchange, quorum=quorum_id, donor=q.donor)
        self._answer(g, exchange, ("catch_up", quorum_id))

    def _assess_votes(self, q: rounds.Quorum, meta: dict[str, Any]) -> None:
        """Before a rolled-back quorum's exchange forms again: judge its votes (``VoteState``)."""
        raise NotImplementedError

    def _answer(self, g: int, exchange: int, answer: Answer) -> None:
        """Answer the waiting asks of group ``g`` for ``exchange`` (lock held)."""
        self._book.answer(g, self._book.take(exchange, g), exchange, answer)
        self._cond.notify_all()

    def _evict(self, g: int, exchange: int, why: str) -> None:
        self._answer(g, exchange, ("evicted", why))
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
            for k in [k for k in self._witnesses if k[0] == old]:
                del self._witnesses[k]
        while len(self._latest) > MAX_ROUNDS_KEPT:
            self._latest.popitem(last=False)

    def _response(self, g: int, answer: Answer) -> QuorumResponse:
        kind, value = answer
        stop = self._stop_reason is not None
        if kind in ("evicted", "finished", "disagreement", "halted"):
            return QuorumResponse(id="", exchange=-1, attempt=0, tag="", numel=0, members={}, weights={}, stop=stop,
                                  evicted=value if kind == "evicted" else "", finished=kind in ("evicted", "finished"),
                                  disagreement=value if kind == "disagreement" else "",
                                  halted=value if kind == "halted" else "")
        q, meta = self._quorums[value]  # stop is frozen when the quorum forms: every member stops at it
        return QuorumResponse(id=q.id, exchange=q.exchange, attempt=q.attempt, tag=q.tag, numel=q.numel,
                              members=dict(meta["members"]), weights=dict(q.weights), healers=q.healers,
                              donor=q.donor, rejected=dict(q.rejected), state_hash=q.state_hash,
                              stop=meta.get("stop", False), setting=meta.get("setting", ""),
                              left_out={} if kind == "catch_up" else dict(meta.get("left_out_members", {})),
                              catch_up=kind == "catch_up")

    def request_stop(self, reason: str) -> None:
        """Ask every group to checkpoint and stop after its next exchange (quorums say ``stop``)."""
        with self._cond:
            if self._stop_reason is None:
                self._stop_reason = reason or "stop requested"
                self._event("stop", reason=self._stop_reason)
            self._cond.notify_all()

    def _release_asks(self, g: int, reason: str) -> None:
        self._healed_at.pop(g, None)
        self._behind.pop(g, None)
        self._vetoes.pop(g, None)
        for exchange in self._book.exchanges():
            self._book.answer(g, self._book.take(exchange, g), exchange, ("evicted", reason))
