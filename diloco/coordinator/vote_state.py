"""The votes on the job's exchanges: every rank votes on the quorum it ran (``commit``), the
quorum commits or rolls back (``rounds.commit_outcome``), and what a commit changes follows: the
job's committed position, the groups the grace window left behind (they catch up), healed groups.
A rolled-back quorum's votes are judged before its exchange forms again (``rounds.blamed``): a
member whose votes alone keep rolling exchanges back is evicted. Healers and groups left behind
fetch what they need from the quorum's donor through its state offers (``offer``/``wait_offer``).

The state lives in ``RoundState`` (``round_state.py``: the asks and quorums), under the lock of
:class:`~diloco.coordinator.joins.Joins`; this class adds the methods that vote on it.
"""

from __future__ import annotations

from typing import Any, Callable

from . import quorum, rounds
from .joins import _POLL_S
from .messages import CommitRequest, CommitResponse, OfferQuery, StateOffer
from .round_state import MAX_BEHIND, MAX_ORPHANS_PER_GROUP, NORM_HISTORY, RoundState


class VoteState(RoundState):
    """Votes, commits and state offers of the job's exchanges, on top of its quorums."""

    def commit(self, req: CommitRequest, *, deadline: float,
               active: Callable[[], bool] = lambda: True) -> CommitResponse:
        """Record this rank's vote and wait for the quorum's decision (``rounds.commit_outcome``).
        A vote on a quorum of a previous coordinator (an *orphan*: only where this coordinator
        started from members rejoining it, never for an exchange it formed a quorum for) is decided
        from the votes and from what the members ask for next, once every member could rejoin, and
        only if its groups are a majority of those that did."""
        with self._cond:
            self._check_open()
            self._sweep()
            key = self._check_member(req.group, req.rank, req.incarnation)
            self._last_heard[key] = self._clock()
            if req.quorum_id not in self._quorums:
                if req.quorum_id.startswith(f"{self.boot}-") or not self.rejoined:
                    raise quorum.QuorumError("NOT_FOUND", f"quorum {req.quorum_id} is unknown or too old")
                latest = self._latest.get(req.exchange)
                if latest is not None and not self._quorums[latest][1]["orphan"]:
                    raise quorum.QuorumError("INVALID_ARGUMENT", f"exchange {req.exchange} runs in quorum {latest} of "
                                             f"this coordinator, not in {req.quorum_id}")
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
                self._check_halted(req.group)
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
        if meta["orphan"] and not self._orphan_decidable(q):
            return
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
            self._advance(q.exchange, orphan=meta["orphan"])
            self._disagreements.pop(q.exchange, None)
            self._splits = 0
            for g in q.groups:
                self._vetoes.pop(g, None)
            self._left_behind(q, meta)
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

    def _orphan_decidable(self, q: rounds.Quorum) -> bool:
        """Whether an orphan quorum's vote may be decided now (lock held): not before every member
        could rejoin (the rejoin grace), and then only if it names a strict majority of the groups
        that rejoined, so that one group's vote on a quorum of itself decides nothing for the
        others (it is rolled back: its members ask again)."""
        if self._clock() < self._rejoin_grace_until:
            return False
        rejoined = {g for g in self._members if self._complete(g) and g not in self._group_failed}
        if 2 * len(set(q.groups) & rejoined) <= len(rejoined):
            self._decisions[q.id] = (False, f"quorum {q.id} of a previous coordinator names groups {list(q.groups)}, "
                                            f"not a majority of the {len(rejoined)} groups that rejoined")
            self._counts["rolled_back"] += 1
            self._cond.notify_all()
            return False
        return True

    def _advance(self, exchange: int, *, orphan: bool = False) -> None:
        """``exchange`` committed: move the job's committed position past it (lock held). An orphan
        (a previous coordinator's quorum) never sets a position this coordinator does not know."""
        if self.frontier is None:
            if orphan:
                return
            self.frontier = exchange
        if exchange < self.frontier:
            return
        self._committed_above.add(exchange)
        while self.frontier in self._committed_above:
            self._committed_above.discard(self.frontier)
            self.frontier += 1

    def _left_behind(self, q: rounds.Quorum, meta: dict[str, Any]) -> None:
        """``q`` committed without the live groups the grace window left out (lock held): one
        still heard from stays a member and catches up when it asks (``_after_commit``); one
        that went silent is failed now, not a heartbeat timeout later."""
        heard = self._heard()
        for g, incarnation in meta.get("left_out", {}).items():
            if self._incarnations.get(g) != incarnation or g in self._healing or g in self._group_failed:
                continue  # it started again meanwhile: that start heals already
            if g not in heard:
                self._fail_group(g, f"missed exchange {q.exchange}: its quorum formed without this group once the "
                                    f"{self.quorum_grace_s:g}s grace window (--quorum-grace) ended, and it has been "
                                    "silent since; it heals into a later exchange")
                continue
            behind = self._behind.setdefault(g, {})
            behind[q.exchange] = q.id
            self._event("behind", group=g, exchange=q.exchange, quorum=q.id, exchanges_behind=len(behind))
            if len(behind) > MAX_BEHIND:
                self._fail_group(g, f"the grace window left it out of {len(behind)} committed exchanges it has not "
                                    f"caught up with (at most {MAX_BEHIND}): it is out of step and heals")

    def _assess_votes(self, q: rounds.Quorum, meta: dict[str, Any]) -> None:
        """Once per rolled-back attempt, as its exchange's next attempt forms (every member that
        is still running has voted by then): count the attempts each member's votes alone rolled
        back (``rounds.blamed``), and evict one that reached ``rounds.VETO_LIMIT`` (lock held)."""
        if meta.get("assessed") or meta["orphan"]:
            return
        meta["assessed"] = True
        failed = self._failed_members(q, meta)
        votes = self._votes.get(q.id, {})
        yes, no = rounds.vote_sides(q, meta["sizes"], votes, failed)
        self._splits = self._splits + 1 if yes and len(yes) == len(no) else 0
        if self._splits >= rounds.VETO_LIMIT:
            said = "; ".join(f"group {g}: {why or 'no vote in time'}" for g in sorted(no)
                             for why in [next((w for (h, _), (ok, w) in sorted(votes.items()) if h == g and not ok), "")])
            self._halt(f"the members' votes split evenly {self._splits} attempts in a row (the last, {q.id}: groups "
                       f"{sorted(yes)} voted to commit, groups {sorted(no)} did not: {said}); the coordinator cannot "
                       "tell a member that vetoes from one whose rings its neighbour broke: check those groups' logs "
                       "and links, then resume from a checkpoint")
            return
        blamed = rounds.blamed(q, meta["sizes"], votes, failed)
        for g in q.groups:
            if g not in blamed and g not in failed:
                self._vetoes.pop(g, None)
        for g in sorted(blamed):
            count = self._vetoes[g] = self._vetoes.get(g, 0) + 1
            if count < rounds.VETO_LIMIT:
                continue
            del self._vetoes[g]
            said = next((why for (h, _), (ok, why) in sorted(votes.items()) if h == g and not ok), "")
            self._evict(g, q.exchange, f"its votes alone rolled back {count} attempts in a row while the other "
                                       f"members voted to commit (the last, {q.id}: "
                                       f"{said or 'no vote in time'}); it restarts and heals")

    def offer(self, req: StateOffer) -> int:
        """A donor rank announces the state it serves to one healer rank, or a member vouches for the
        committed mean a left-out group fetches from the donor (its SHA-256: a *witness*); returns
        the epoch."""
        with self._cond:
            self._check_open()
            self._check_halted(req.donor_group)
            if req.quorum_id not in self._quorums:
                raise quorum.QuorumError("NOT_FOUND", f"quorum {req.quorum_id} is unknown or too old")
            q, _ = self._quorums[req.quorum_id]
            if req.donor_group in self._group_failed:
                raise quorum.QuorumError("FAILED_PRECONDITION", f"group {req.donor_group} was declared failed: "
                                         f"{self._group_failed[req.donor_group]}")
            witness = req.healer_group in q.left_out and req.donor_group in q.groups and req.donor_group not in q.healers
            if witness:
                self._witnesses.setdefault((q.id, req.healer_group), {})[req.donor_group] = req.digest
            if req.donor_group != q.donor or req.healer_group not in (*q.healers, *q.left_out):
                if not witness:
                    raise quorum.QuorumError("INVALID_ARGUMENT", f"quorum {q.id}: donor is group {q.donor}, healers "
                                             f"{list(q.healers)}, left out {list(q.left_out)}")
            else:
                self._offers[(req.quorum_id, req.healer_group, req.healer_rank)] = req
            self._cond.notify_all()
            return self._epoch_locked()

    def _vouched(self, q: rounds.Quorum, offer: StateOffer) -> bool:
        """Whether a strict majority of ``q``'s members vouch for the digest the donor offers a
        left-out group (always True for a healer: its state is checked against the agreed hash)."""
        if offer.healer_group not in q.left_out:
            return True
        said = self._witnesses.get((q.id, offer.healer_group), {})
        members = [g for g in q.groups if g not in q.healers]
        return 2 * sum(d == offer.digest for g, d in said.items() if g in members) > len(members)

    def wait_offer(self, req: OfferQuery, *, deadline: float,
                   active: Callable[[], bool] = lambda: True) -> StateOffer:
        """Wait for the donor's offer to this healer rank (to a left-out group's rank: once a strict
        majority of the members vouch for its digest); ABORTED if the quorum was rolled back or its
        donor failed first (heal again with the next quorum)."""
        key = (req.quorum_id, req.healer_group, req.healer_rank)
        with self._cond:
            while True:
                self._check_open()
                self._check_halted(req.healer_group)
                self._sweep()
                entry = self._quorums.get(req.quorum_id)
                if entry is None:
                    raise quorum.QuorumError("NOT_FOUND", f"quorum {req.quorum_id} is unknown or too old")
                q, _ = entry
                offer = self._offers.get(key)
                if offer is not None and self._vouched(q, offer):
                    return offer
                decided = self._decisions.get(q.id)
                if q.donor in self._group_failed or (decided is not None and not decided[0]):
                    raise quorum.QuorumError("ABORTED", f"quorum {q.id} failed before its donor offered: "
                                             f"{self._group_failed.get(q.donor) or decided[1]}")  # type: ignore[index]
                remaining = deadline - self._clock()
                if remaining <= 0 or not active():
                    raise quorum.QuorumError("DEADLINE_EXCEEDED", f"no state offer for quorum {q.id} yet"
                                             + ("" if offer is None else ": the donor's digest is not vouched for by "
                                                "a majority of the members"))
                self._cond.wait(min(remaining, _POLL_S))
