"""The coordinator's membership: groups join (under an incarnation), the job starts once every
expected group has all its ranks (from the newest checkpoint step the groups hold, ``resume``), and
a group that joins while the job runs (new, restarted, or failed earlier) joins as a healer. The
addresses of a failed group are kept from the others while it restarts.

Thread-safe (one condition variable, which ``Liveness``, the rounds part and ``CoordinatorState``
built on this class share), independent of gRPC: handlers call these methods and turn
:class:`~diloco.coordinator.quorum.QuorumError` into a status code.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable

from . import quorum, resume, rounds
from .membership import Membership
from .messages import JoinRequest

log = logging.getLogger(__name__)

_POLL_S = 0.25  # how often a waiting call re-checks liveness and whether its caller is still there
MAX_EVENTS_KEPT = 1024  # failures, rejections, rollbacks kept for snapshots, oldest dropped first
#: after a coordinator restart, the least time given to every member to rejoin before a quorum forms
#: without one (seconds): a rank's channel redials within client.MAX_RECONNECT_BACKOFF_MS and then
#: heartbeats (NOT_FOUND: rejoin) within one heartbeat interval
MIN_REJOIN_GRACE_S = 5.0


class Joins:
    """Who is in the job: its groups' joins, incarnations and the membership they receive; all
    times are ``clock()`` seconds (monotonic). Holds the state ``Liveness`` (who is still heard
    from, which groups failed or finished) reads and changes, and the job's counters and event
    log, which the rounds part (``round_state.RoundState``) adds to."""

    #: set when the job's state is lost and this coordinator restarts
    #: (``Liveness.restart_when_state_lost``): a join is refused with it
    state_lost: str | None = None
    #: set at once when every group of the running job failed (``rounds.job_lost``): what the
    #: coordinator says in its log, status, metrics and to any group that comes back
    job_lost: str | None = None
    #: set once the job cannot go on without an operator (``round_state``: members that disagree
    #: with no majority, again): every later call of a member is refused with it, and the
    #: ``diloco-halted`` trailer says that no restart mends it (exit 2, not 75)
    halted: str | None = None

    def __init__(self, expected_groups: int, *, join_timeout_s: float, heartbeat_timeout_s: float,
                 max_group_size: int, clock: Callable[[], float]) -> None:
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
        self._epoch = 0
        self._complete_at = 0.0
        self._last_heard: dict[tuple[int, int], float] = {}
        self._failed: dict[tuple[int, int], float] = {}  # member -> seconds silent when marked
        self._steps: dict[tuple[int, int], int] = {}
        self._summaries: dict[int, dict[str, Any]] = {}
        #: before the job starts: group -> rank -> (the newest checkpoint step it may resume from, named)
        self._resume_steps: dict[int, dict[int, tuple[int, bool]]] = {}
        #: the checkpoint step the job started from (``resume.NONE``: none)
        self.resume_step = resume.NONE
        #: the groups that joined with an older checkpoint step than it (they heal): group -> their step
        self.resumed_behind: dict[int, int] = {}
        # fault tolerance (see rounds.py)
        self._started = False  # the job runs: the first membership formed, or a member rejoined us
        self._rejoin_grace_until = 0.0  # after our restart: no quorum before members could rejoin
        #: the job started here from members rejoining (this coordinator replaced another): only then
        #: are votes on a previous coordinator's quorums taken (``vote_state``)
        self.rejoined = False
        #: address -> (group, until): the addresses of a failed group, kept from the others for a while
        #: (its restart rejoins with them), so no other group's rank can take them meanwhile
        self._reserved: dict[str, tuple[int, float]] = {}
        self._incarnations: dict[int, str] = {}
        self._group_failed: dict[int, str] = {}  # group -> why (until it starts again)
        self._healing: set[int] = set()  # joined while the job ran; a member once a quorum commits
        #: --codec/--h auto: the setting the members of the latest quorum asked with (a healer builds
        #: its engine with it before it asks to heal); "" before one, or without auto
        self.latest_setting = ""
        self._counts = {"committed": 0, "committed_training": 0, "rolled_back": 0, "heals": 0, "failures": 0, "rejected": 0,
                        "evicted": 0, "caught_up": 0}
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
            if self.state_lost is not None:  # this coordinator is about to restart: join its successor
                raise quorum.QuorumError("UNAVAILABLE", f"the coordinator restarts: {self.state_lost}")
            if self.job_lost is not None:
                raise quorum.QuorumError("FAILED_PRECONDITION", f"group {req.group}: {self.job_lost}")
            self._check_halted(req.group)
            if not self._started and req.exchange >= 0:
                self._start_running()  # our predecessor's job goes on: members rejoin us
                self.rejoined = True
                # every member rejoins within a heartbeat or so: no quorum forms before they could,
                # else the first to rejoin would run an exchange the others then find committed
                self._rejoin_grace_until = self._clock() + max(self.heartbeat_timeout_s, MIN_REJOIN_GRACE_S)
                for g in sorted(self._members):  # started afresh and joined before: no state of this job
                    self._healing.add(g)
                    self._event("joined", group=g, committed=self._counts["committed"])
                self._cond.notify_all()  # their joins return, as healers
            if self._started:
                return self._join_running(req, deadline, active)
            if self._incarnations.get(req.group, req.incarnation) != req.incarnation:
                self._members.pop(req.group, None)  # the group started again before the job did
                self._sizes.pop(req.group, None)
                self._resume_steps.pop(req.group, None)
            self._incarnations[req.group] = req.incarnation
            self._check_reserved(req.group, req.address)
            admission = quorum.admit(
                self._members, self._sizes, self.expected_groups, self.max_group_size,
                req.group, req.rank, req.group_size, req.address,
                may_replace=self._waiting.get(key, 0) == 0)
            self._note_resume_step(req)
            if admission is not quorum.Admission.SAME:
                self._members.setdefault(req.group, {})[req.rank] = req.address
                self._sizes[req.group] = req.group_size
            self._failed.pop(key, None)
            self._last_heard[key] = self._clock()
            if quorum.is_complete(self._members, self._sizes, self.expected_groups):
                self._form()
            self._wait_joined(key, deadline, active, lambda: self._membership is not None or self._started,
                              lambda: quorum.missing(self._members, self._sizes, self.expected_groups))
            if self._membership is None:  # a predecessor's members rejoined meanwhile: it heals into the job
                return self._running_membership(req, deadline, active)
            self._check_halted(req.group)  # e.g. a named checkpoint step that is not every group's
            return dataclasses.replace(self._membership, heal=req.group in self._healing,
                                       resume_step=self.resume_step)

    def _note_resume_step(self, req: JoinRequest) -> None:
        """Keep the checkpoint step a rank joining before the start may resume from (lock held);
        the ranks of one group must name the same one."""
        ranks = self._resume_steps.setdefault(req.group, {})
        mine = (req.resume_step, req.resume_exact)
        other = next(((r, s) for r, s in ranks.items() if r != req.rank and s != mine), None)
        if other is not None:
            def said(step: int, exact: bool) -> str:
                return f"step {step}" + (" (named)" if exact else "")

            raise quorum.QuorumError(
                "INVALID_ARGUMENT", f"group {req.group} rank {req.rank} resumes from {said(*mine)}, its rank "
                f"{other[0]} from {said(*other[1])}: every rank of a group reads the same checkpoint folder")
        ranks[req.rank] = mine

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
            if g in self._summaries and rounds.summary_kind(self._summaries[g]) == rounds.STOPPED:
                del self._summaries[g]  # back after its SIGTERM stop: it trains on, not finished
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
        self._check_reserved(g, req.address)
        quorum.admit(self._members, self._sizes, self.expected_groups, self.max_group_size,
                     g, req.rank, req.group_size, req.address, may_replace=False)
        self._members.setdefault(g, {})[req.rank] = req.address
        self._sizes[g] = req.group_size
        self._failed.pop(key, None)
        self._last_heard[key] = self._clock()
        self._cond.notify_all()
        return self._running_membership(req, deadline, active)

    def _running_membership(self, req: JoinRequest, deadline: float, active: Callable[[], bool]) -> Membership:
        """Wait for the rest of the joining group's ranks, then its membership in the running job."""
        g, key = req.group, (req.group, req.rank)
        self._wait_joined(key, deadline, active, lambda: self._complete(g) or g in self._group_failed,
                          lambda: quorum.missing({g: self._members.get(g, {})}, {g: req.group_size}, g + 1))
        if g in self._group_failed:
            raise quorum.QuorumError("ABORTED", f"group {g} failed while it joined: {self._group_failed[g]}")
        # the groups it may exchange with: not failed, and not finished (a finished group's data
        # plane is closed: a healer that dialed it would wait out its deadline, and when every
        # other group has finished it learns so from its first quorum, at once)
        members = {h: tuple(self._members[h][r] for r in range(self._sizes[h]))
                   for h in sorted(self._members) if self._complete(h) and h not in self._group_failed
                   and (h == g or h not in self._summaries)}
        return Membership(epoch=self._epoch, members=members, ring=tuple(sorted(members)),
                          heal=g in self._healing, setting=self.latest_setting, resume_step=self.resume_step)

    def _check_reserved(self, group: int, address: str) -> None:
        """Refuse ``address`` to ``group`` while a failed group other than it holds it (lock held)."""
        owner, until = self._reserved.get(address, (group, 0.0))
        if owner != group and self._clock() < until:
            raise quorum.QuorumError("FAILED_PRECONDITION",
                                     f"address {address} belongs to group {owner}, which failed and restarts: "
                                     f"group {group} cannot take it")

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
        self._start_from_checkpoints()
        self._start_running()
        self._cond.notify_all()

    def _start_from_checkpoints(self) -> None:
        """As the job starts (lock held): the step it resumes from, the groups behind it made
        healers, or the job halted when a named step is not every group's (``resume``)."""
        steps = {g: ranks[0][0] for g, ranks in self._resume_steps.items() if 0 in ranks and g in self._members}
        named = {g for g, ranks in self._resume_steps.items() if g in steps and ranks[0][1]}
        start = resume.resume_start(steps, named)
        if start.refused is not None:
            self.halted = start.refused
            self._event("halted", reason=start.refused)
            log.error("the job cannot start: %s", start.refused)
            return
        self.resume_step = start.step
        if start.step != resume.NONE:
            log.info("the job resumes from checkpoint step %d (%s)%s", start.step, resume.describe(steps),
                     f"; behind it, healing from the others: groups {list(start.behind)}" if start.behind else "")
        for g in start.behind:
            self._healing.add(g)
            self.resumed_behind[g] = steps.get(g, resume.NONE)
            self._event("resume_behind", group=g, step=steps[g], resume_step=start.step)

    @property
    def epoch(self) -> int:
        """Membership epoch: 0 until the job starts, then +1 on every change of members."""
        with self._cond:
            return self._epoch

    def _check_halted(self, group: int) -> None:
        """Refuse every call of a halted job (lock held), saying why."""
        if self.halted is not None:
            raise quorum.QuorumError("FAILED_PRECONDITION", f"group {group}: the job halted: {self.halted}",
                                     halted=True)

    def _fail_group(self, g: int, reason: str) -> None:
        """Take group ``g`` out of the job (lock held): ``Liveness`` does; a join under a new
        incarnation of a running group calls it."""
        raise NotImplementedError

    # --- closing ------------------------------------------------------------------------------

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

    # --- the event log; what the rounds part adds ---------------------------------------------

    def _event(self, kind: str, **fields: Any) -> None:
        self._event_seq += 1
        self._events[self._event_seq] = {"seq": self._event_seq, "kind": kind,
                                         "at_s": round(self._clock() - self._started_at, 3), **fields}
        while len(self._events) > MAX_EVENTS_KEPT:
            self._events.popitem(last=False)

    def _release_asks(self, g: int, reason: str) -> None:
        """Answer group ``g``'s waiting quorum requests: it left the job for ``reason`` (lock held).
        ``Joins`` and ``Liveness`` keep none; ``RoundState`` overrides this."""
