"""Liveness of the coordinator's groups: who is still heard from, which groups failed (and when the
whole job is lost), and which finished.

Once the job started, a rank not heard from (join, heartbeat, progress, quorum, vote) for
``heartbeat_timeout_s`` fails its whole group: the group leaves the membership, every quorum and
vote it was part of is decided without it, and its later calls are refused (FAILED_PRECONDITION)
until it starts again under a new incarnation, when it joins as a healer (``joins``). A group that
reported its summary has finished: it goes quiet without failing.
"""

from __future__ import annotations

import copy
import logging

from . import quorum, rounds
from .joins import Joins
from .messages import HeartbeatRequest, SummaryRequest

log = logging.getLogger(__name__)

#: ranks heartbeat this many times per heartbeat timeout; a group silent for ``SILENT_INTERVALS`` of
#: those intervals is no longer *heard*: a grace window does not wait for it, and as a member of an
#: exchange in flight it is failed (``round_state``). Frequent enough that a frozen member is noticed
#: in a small part of the timeout (0.6 s at 3 s), sparse enough to cost nothing (one small call a
#: second per rank at the default 15 s); three intervals, so one heartbeat late by up to two
#: intervals (a busy host) is not silence.
HEARTBEATS_PER_TIMEOUT = 15
SILENT_INTERVALS = 3


def heartbeat_interval_s(heartbeat_timeout_s: float) -> float:
    """Seconds between a rank's heartbeats for a coordinator's ``heartbeat_timeout_s``."""
    return heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT


class Liveness(Joins):
    """Who of the joined groups is alive, failed or finished, on ``Joins``' state and lock."""

    #: with it on (``diloco coordinator``), once every group was lost while the job ran (healers
    #: wait and no group holds the job's state) the healers are evicted and ``state_lost`` says
    #: why: the coordinator then restarts, and the groups resume from their job checkpoints
    restart_when_state_lost = False
    #: the newest checkpoint the coordinator knows of, named in ``job_lost`` ("" = none)
    checkpoint_hint: str = ""

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

    def group_exited(self, g: int, reason: str) -> bool:
        """Fail group ``g`` now because the launcher saw its process tree end (killed, crashed):
        the others' quorums, votes and ring retries go on without waiting for its heartbeats to
        stop. True if this failed it; False if it was failed already, never joined, or finished
        (sent its summary). Only the launcher that started the group calls this, in process."""
        with self._cond:
            if g in self._summaries or g in self._group_failed or g not in self._incarnations:
                return False
            self._fail_group(g, reason)
            return True

    def _silence(self) -> dict[int, float]:
        """Group -> seconds since its most silent rank was last heard from (lock held)."""
        now, out = self._clock(), {}
        for (g, _), t in self._last_heard.items():
            out[g] = max(out.get(g, 0.0), now - t)
        return out

    def _heard_limit_s(self) -> float:
        """Seconds of silence after which a group is no longer heard: three heartbeat intervals."""
        return SILENT_INTERVALS * heartbeat_interval_s(self.heartbeat_timeout_s)

    def _heard(self) -> set[int]:
        """Groups every rank of which was heard from within three heartbeat intervals (lock held)."""
        limit = self._heard_limit_s()
        return {g for g, silent in self._silence().items() if silent <= limit}

    def _fail_group(self, g: int, reason: str) -> None:
        """Take group ``g`` out of the job (lock held): its waiting calls are answered, every quorum
        and vote goes on without it, and it must join again (as a healer) to come back."""
        if g in self._group_failed or g not in self._incarnations:
            return
        self._group_failed[g] = reason
        self._counts["failures"] += 1
        self._event("failure", group=g, reason=reason)
        until = self._clock() + 10 * self.heartbeat_timeout_s
        for r, address in self._members.get(g, {}).items():
            self._last_heard.pop((g, r), None)
            self._reserved[address] = (g, until)
        for address in [a for a, (_, t) in self._reserved.items() if t <= self._clock()]:
            del self._reserved[address]
        self._members.pop(g, None)
        self._healing.discard(g)
        self._release_asks(g, reason)
        self._epoch += 1
        self._note_job_lost()
        self._cond.notify_all()

    def _note_job_lost(self) -> None:
        """Say at once that the job is lost once no group holds its state (lock held): every
        group that joined failed or is a healer, and none finished (``rounds.job_lost``)."""
        if self.job_lost is not None or not self._started:
            return
        if not rounds.job_lost(set(self._incarnations), set(self._group_failed), self._healing,
                               rounds.trained_groups(self._summaries)):
            return
        self.job_lost = rounds.job_lost_message(self.checkpoint_hint)
        self._event("job_lost", reason=self.job_lost, failed=dict(sorted(self._group_failed.items())))
        log.error("%s (failed: %s)", self.job_lost,
                  "; ".join(f"group {g}: {why}" for g, why in sorted(self._group_failed.items())))
        if self.restart_when_state_lost:
            self.state_lost = self.job_lost

    def _known(self, group: int, rank: int) -> tuple[int, int]:
        key = (group, rank)
        self._check_halted(group)
        if self.state_lost is not None or self.job_lost is not None:  # tell each process that calls
            raise quorum.QuorumError("FAILED_PRECONDITION", f"group {group}: {self.state_lost or self.job_lost}")
        if rank not in self._members.get(group, {}):
            raise quorum.QuorumError("NOT_FOUND", f"group {group} rank {rank} has not joined")
        return key

    def _check_member(self, group: int, rank: int, incarnation: str) -> tuple[int, int]:
        """Refuse calls from failed, stale or unknown members (lock held); returns the key."""
        key = (group, rank)
        self._check_halted(group)
        if self.state_lost is not None or self.job_lost is not None:  # tell each process that calls
            raise quorum.QuorumError("FAILED_PRECONDITION", f"group {group}: {self.state_lost or self.job_lost}")
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

    def _known_group(self, group: int) -> None:
        if group not in self._members and group not in self._incarnations:
            raise quorum.QuorumError("NOT_FOUND", f"group {group} has no joined rank")

    def _member_group(self, group: int) -> None:
        """Refuse a group that is not a member now (lock held): one declared failed (it must join
        again and heal first) with FAILED_PRECONDITION, one that never joined with NOT_FOUND."""
        if group in self._group_failed:
            raise quorum.QuorumError("FAILED_PRECONDITION",
                                     f"group {group} is not a member: it was declared failed "
                                     f"({self._group_failed[group]}); join again to heal")
        if group not in self._members:
            raise quorum.QuorumError("NOT_FOUND", f"group {group} is not a member: it has no joined rank")

    # --- finished groups ----------------------------------------------------------------------

    def summary(self, req: SummaryRequest) -> int:
        """Keep a group's final summary (the latest wins, but a late join's never replaces the
        summary of a model the group trained to the end: a restart after it finished; and one that
        names an incarnation other than the group's latest, a process its restart replaced, is
        ignored) and wake wait_for_summaries and wait_finished."""
        with self._cond:
            self._check_open()
            self._known_group(req.group)
            kept = self._summaries.get(req.group)
            sent_by = req.summary.get("incarnation")
            if isinstance(sent_by, str) and sent_by and self._incarnations.get(req.group, sent_by) != sent_by:
                self._event("stale_summary_ignored", group=req.group, incarnation=sent_by[:32])
            elif (kept is not None and rounds.summary_kind(kept) == rounds.TRAINED
                    and rounds.summary_kind(req.summary) == rounds.LATE):
                self._event("late_summary_ignored", group=req.group)
            else:
                self._summaries[req.group] = copy.deepcopy(req.summary)
            self._cond.notify_all()
            return self._epoch_locked()
