"""Quorum per round, the commit vote and the contribution screen: pure decisions.

Every exchange between groups (an outer round, or one fragment's sync in streaming modes) runs
among a *quorum* the coordinator hands out. These functions decide, from what the groups asked and
voted, who is in it, with which weights, and whether its result may be applied. Nothing here
keeps state, takes locks or reads a clock, so every rule is tested without processes.

Rules (docs/fault_tolerance.md §2-3). They hold whatever one member says: every input from a
member (its exchange, hash, setting, size, weight, vote) is one member's word, so no rule lets one
group's word decide for the others, and no rule breaks a tie by group id.

* a quorum for exchange E forms once every live group (joined, not failed, not healing) has asked
  for a quorum, and at least ``min_groups`` groups are in it (for a control exchange, which no
  healer takes part in, counting the groups healing into the job); groups that asked to heal join
  the next quorum that forms. E must lie within ``MAX_EXCHANGES_AHEAD`` of the job's committed position
  (the caller refuses asks beyond it);
* with a grace window (``grace_s`` > 0), the quorum also forms once ``grace_s`` seconds passed
  (``waited_s``) since the groups that asked became a strict majority of the live groups still
  heard from (``heartbeating``: a group silent for three heartbeat intervals is not counted; the
  caller starts the clock then, so one group asking early cannot start it), or at once while the
  window runs when none of the groups it waits for is still heard from (``window_closed``), with
  the groups that asked by then if they are still that majority: one group never forms a quorum
  while another live group heartbeats, and a member asking far ahead waits alone. The live groups
  that had not asked are *left out* (``Quorum.left_out``): they stay members, and once E commits
  they take its committed mean at weight 0 (they *catch up*; the caller decides this). Control exchanges (the
  initial agreement, a final reconcile: ``healable`` False, agreed like the values below) wait for
  every live group, and the caller applies no window before the job's first training commit. A
  group that healed in an earlier exchange and has not asked for a later one yet is waited for past
  the window while it is heard from (``patient_groups``);
* the non-healing members must agree on the exchange's tag and size, its kind (training or
  control), the hash of the global state they start from, the setting they run (``--codec/--h
  auto``) and the weight cap of their schedule. The value most members hold wins when no other
  value is held by as many: a member holding another is *evicted* (stopped and healed), never
  averaged. A tie (two groups that differ, or two values held by as many groups) evicts nobody:
  while some live group has not asked it waits (that group may make a majority); once every live
  group asked it is a ``Disagreement``, the attempt is rolled back, and ``DISAGREEMENT_LIMIT`` of
  them in a row halt the job with an error naming the groups and what differs;
* healers and left-out groups fetch from a ``donor`` member that turns with the exchange;
* weights: a member's weight is what it contributed since its last exchange (tokens, or inner
  steps x ranks); healers and rejected contributions weigh 0. The mean is the weighted mean. A
  weight above what the group can have trained in one exchange (the agreed weight cap per rank,
  times its ranks) is refused;
* a contribution is *rejected* if its norm is NaN/Inf, or larger than ``factor`` times the median
  of the group's last accepted norms (once ``min_history`` are known; ``factor`` 0 turns this off);
* a quorum's result is applied (committed) only if every rank of every member voted that its
  collective finished; any failed vote, or a member declared failed, rolls it back on everyone.
  A member whose no (or missing) vote alone rolled back ``VETO_LIMIT`` attempts in a row, while
  more members voted yes, is evicted (``blamed``); as many votes each way (a split) blames nobody,
  and ``VETO_LIMIT`` splits in a row halt the job.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence

HEAL = -1  # the exchange a group asks for when it needs the job's state first
#: how far past the job's committed position (its lowest exchange not yet committed) an exchange may
#: be asked for: an honest group has at most one exchange in flight per fragment, plus a control
#: exchange, and an engine has at most ``diloco.engine.modes.MAX_FRAGMENTS`` (32) fragments
MAX_EXCHANGES_AHEAD = 64
#: attempts in a row whose roll-back one member alone caused (a no vote, or no vote at all, while
#: more members voted yes) before it is evicted; and splits in a row (as many each way) before the
#: job halts. One is an ordinary fault (a corrupt frame, a neighbour lost before the coordinator said
#: so), two happen while a fault outlives one retry; three is a member whose rings always fail (a
#: broken link or build) or that vetoes on purpose, and evicting it (a restart and a heal) is what its
#: own ranks would do after ``max_attempts``, sooner
VETO_LIMIT = 3
#: ties on one exchange in a row (``Disagreement``) before the job halts: honest members never
#: differ in hash, shape, setting or weight cap, so a second one is not a transient
DISAGREEMENT_LIMIT = 2


@dataclass(frozen=True)
class Ask:
    """One group's request for a quorum (its rank 0's fields; every rank of it asked)."""

    exchange: int  # the exchange the group is about to run; HEAL to join the next one as a healer
    tag: str = ""  # the exchange's name, e.g. "f0/r12" (fragment 0, round 12)
    numel: int = 0  # elements of the exchanged vector
    weight: float = 0.0  # what this group contributed since its last exchange (tokens)
    state_hash: str = ""  # hash of its global state before this exchange ("" = not compared)
    delta_norm: float = 0.0  # L2 norm of its contribution (NaN/Inf = non-finite)
    healable: bool = True  # healers may join this exchange
    setting: str = ""  # --codec/--h auto: the setting (a row of the study's table) it runs; "" none
    #: the most tokens one rank of it can contribute to one exchange under its schedule (0: none said)
    weight_cap: float = 0.0
    size: int = 1  # its ranks (from the membership, not from its word)


@dataclass(frozen=True)
class Disagreement:
    """Members of one exchange that differ in ``what`` with no value held by more groups than any
    other (two groups that differ, or two values held by as many): nobody can be evicted on one
    member's word, so the attempt is rolled back (and repeated, the job halts: ``message``)."""

    exchange: int
    what: str  # "exchange tag and size", "global state hash", "auto setting", "weight cap"
    values: Mapping[int, str]  # group -> the value it asked with

    def message(self) -> str:
        """One line naming every group and what it said."""
        said = "; ".join(f"group {g}: {v}" for g, v in sorted(self.values.items()))
        return f"the members of exchange {self.exchange} differ in their {self.what} and no value has a majority ({said})"


@dataclass(frozen=True)
class Quorum:
    """The members of one attempt at one exchange, as every member receives it."""

    id: str
    exchange: int
    attempt: int
    tag: str
    numel: int
    groups: tuple[int, ...]  # sorted member ids (healers included)
    weights: Mapping[int, float]  # by group: 0 for healers and rejected contributions
    healers: tuple[int, ...] = ()
    donor: int = -1  # the member whose state healers fetch (-1: no healers)
    rejected: Mapping[int, str] = field(default_factory=dict)  # group -> why its Δ is not used
    evicted: Mapping[int, str] = field(default_factory=dict)  # group -> why it must stop and heal
    state_hash: str = ""  # the agreed global-state hash the exchange starts from
    left_out: tuple[int, ...] = ()  # live groups that had not asked when the grace window ended
    setting: str = ""  # --codec/--h auto: the setting every member runs ("" none)

    @property
    def contributors(self) -> tuple[int, ...]:
        """Members whose contribution carries weight."""
        return tuple(g for g in self.groups if self.weights.get(g, 0.0) > 0)


def screen(norm: float, history: Sequence[float], factor: float, min_history: int = 3) -> str | None:
    """Why a contribution of L2 norm ``norm`` is rejected given the group's last accepted norms,
    or None if it is accepted. ``factor`` <= 0 turns the outlier rule off (NaN/Inf still fail)."""
    if not math.isfinite(norm):
        return f"pseudo-gradient norm is {norm} (NaN/Inf)"
    if factor > 0 and len(history) >= min_history:
        median = statistics.median(history)
        if median > 0 and norm > factor * median:
            return (f"pseudo-gradient norm {norm:.4g} is {norm / median:.1f}x the median "
                    f"{median:.4g} of its last {len(history)} (limit {factor:g}x)")
    return None


def winner(values: Mapping[int, object]) -> object | None:
    """The value more groups hold than any other value, or None on a tie (no group id decides)."""
    counts = Counter(values.values()).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return None
    return counts[0][0]


def _agree(current: Mapping[int, Ask], evicted: dict[int, str], exchange: int
           ) -> tuple[dict[str, object], Disagreement | None]:
    """The values the members agree on (shape, hash, setting, weight cap), each member that holds
    another evicted into ``evicted``; or the first Disagreement (a tie)."""
    rules = (("exchange tag and size", lambda a: (a.tag, a.numel), lambda v: f"{v[0]!r} of {v[1]} elements"),
             ("kind of exchange", lambda a: a.healable, lambda v: "a training exchange" if v else "a control exchange"),
             ("global state hash", lambda a: a.state_hash, lambda v: v or "(none)"),
             ("auto setting", lambda a: a.setting, repr),
             ("weight cap", lambda a: a.weight_cap, lambda v: f"{v:g} tokens per rank"))
    agreed: dict[str, object] = {}
    for what, key, show in rules:  # "" and 0 are values too: honest members of one exchange all say them or none
        values = {g: key(a) for g, a in current.items() if g not in evicted}
        if not values:
            continue
        best = winner(values)
        if best is None:
            return agreed, Disagreement(exchange, what, {g: show(v) for g, v in values.items()})
        agreed[what] = best
        for g, v in values.items():
            if v != best:
                evicted[g] = f"its {what} {show(v)} differs from the other members' {show(best)}"
    return agreed, None


def grace_over(waited_s: float | None, grace_s: float) -> bool:
    """True once an exchange's grace window has ended: ``grace_s`` > 0 (0 = no window: wait for
    every live group) and ``waited_s`` (seconds since the first group asked for this attempt, None
    before any asked) reached it."""
    if grace_s < 0 or not math.isfinite(grace_s):
        raise ValueError(f"grace_s must be a finite number of seconds >= 0 (0: off), got {grace_s}")
    return grace_s > 0 and waited_s is not None and waited_s >= grace_s


def window_closed(missing: Collection[int], waited_s: float | None, grace_s: float,
                  heartbeating: Collection[int] | None) -> bool:
    """True once an exchange may form without the live groups ``missing`` (that have not asked):
    its grace window ended (``grace_over``), or the window runs (``grace_s`` > 0, ``waited_s`` not
    None) and none of them is ``heartbeating`` any more: the window waits for a late group that is
    alive, not for one that has gone silent (frozen or dead)."""
    if grace_over(waited_s, grace_s):
        return True
    return (grace_s > 0 and waited_s is not None and heartbeating is not None
            and not any(g in heartbeating for g in missing))


def patient_groups(healed_at: Mapping[int, int], exchange: int, silent_s: Mapping[int, float],
                   limit_s: float) -> set[int]:
    """The groups a grace window does not cut from ``exchange``: healed in an earlier exchange
    (``healed_at``: group -> that exchange, kept until the group asks for a later one) and heard
    from (every rank) within ``limit_s`` seconds (``silent_s``: group -> its longest silence), so
    still alive and fetching its state rather than dead."""
    return {g for g, e in healed_at.items() if e < exchange and silent_s.get(g, float("inf")) <= limit_s}


def donor(members: Sequence[int], exchange: int) -> int:
    """The member healers and left-out groups fetch from in ``exchange``: one that turns with the
    exchange (never always the same group id), so a donor that never serves holds no group out for
    longer than one exchange."""
    ordered = sorted(members)
    return ordered[exchange % len(ordered)]


def decide(asks: Mapping[int, Ask], live: set[int], *, next_exchange: int | None, min_groups: int,
           attempt: int, quorum_id: str, rejected: Mapping[int, str] | None = None,
           waited_s: float | None = None, grace_s: float = 0.0,
           patient: Collection[int] = (), heartbeating: Collection[int] | None = None,
           healing: Collection[int] = ()) -> Quorum | Disagreement | None:
    """The quorum to hand out now, a Disagreement (roll the attempt back), or None while it must wait.

    ``asks``: the groups every rank of which asked (HEAL for healers). ``live``: the groups that
    count as members (joined, not failed, not healing) — a live group that has not asked is waited
    for, until the grace window ends (``window_closed``: ``grace_over(waited_s, grace_s)``, or none
    of the missing groups is ``heartbeating``; ``waited_s``: seconds since the groups that asked
    became a majority); it is then left out (``Quorum.left_out``),
    unless it is ``patient`` (waited for regardless of the window), the exchange is a control
    exchange, or the groups that asked are not a strict majority of the live groups that asked or
    are ``heartbeating`` (None: every live group counts).
    ``next_exchange``: the job's next exchange (None after a coordinator restart: the one most
    groups ask for, the latest on a tie). ``attempt``: how many quorums this exchange had before.
    ``rejected``: contributions the caller's screen refused (group -> reason). ``healing``: the
    groups healing into the job and heard from, asked yet or not; a control exchange counts them
    towards ``min_groups`` (they take part in the next training exchange, which waits for them).
    """
    missing = sorted(g for g in live if g not in asks)
    if missing and (not window_closed(missing, waited_s, grace_s, heartbeating)
                    or any(g in patient for g in missing)):
        return None
    regular = {g: a for g, a in asks.items() if a.exchange != HEAL}
    if not regular:
        return None  # healers alone have no state to fetch
    if next_exchange is None:  # after a coordinator restart: what most groups ask for
        counts = Counter(a.exchange for a in regular.values())
        next_exchange = max(e for e, n in counts.items() if n == max(counts.values()))
    exchange = next_exchange
    evicted = {g: f"asked for exchange {a.exchange}, the job is at exchange {exchange}"
               for g, a in regular.items() if a.exchange != exchange}
    current = {g: a for g, a in regular.items() if g not in evicted}
    if not current:
        return None  # only groups out of step asked; the job's current members have not yet
    agreed, disagreement = _agree(current, evicted, exchange)
    if disagreement is not None:  # while some live group has not asked, it may make a majority
        return None if missing else disagreement
    healable = bool(agreed.get("kind of exchange", True))
    if missing and not healable:
        return None  # a control exchange waits for every live group
    members = sorted(g for g in current if g not in evicted)
    if missing:  # the window ended: only a strict majority of the groups still heard from goes on
        heard = set(live) if heartbeating is None else set(heartbeating)
        counted = set(members) | {g for g in missing if g in heard}
        if 2 * len(members) <= len(counted):
            return None
    healers = sorted(g for g, a in asks.items() if a.exchange == HEAL) if healable else []
    # a control exchange goes on when the groups healing in make up min_groups: no healer takes part
    # in one, so it would wait for them and they for it (a job resumed with a group behind)
    coming = set(healers) if healable else ({g for g, a in asks.items() if a.exchange == HEAL} | set(healing))
    if not members or len(members) + len(coming - set(members)) < min_groups:
        return None
    refused = {g: r for g, r in (rejected or {}).items() if g in members}
    cap = float(agreed.get("weight cap", 0.0))  # type: ignore[arg-type]
    for g in members:
        w = current[g].weight
        if g not in refused and cap > 0 and w > cap * current[g].size:
            refused[g] = (f"weight {w:g} is more than group {g} can have trained in one exchange "
                          f"({cap:g} tokens per rank x {current[g].size} ranks)")
    weights = {g: (0.0 if g in refused else float(current[g].weight)) for g in members}
    weights.update({g: 0.0 for g in healers})
    tag, numel = agreed.get("exchange tag and size", ("", 0))  # type: ignore[misc]
    return Quorum(id=quorum_id, exchange=exchange, attempt=attempt, tag=str(tag), numel=int(numel),
                  groups=tuple(sorted(members + healers)), weights=weights, healers=tuple(healers),
                  donor=donor(members, exchange) if healers or missing else -1, rejected=refused, evicted=evicted,
                  state_hash=str(agreed.get("global state hash", "")), left_out=tuple(missing),
                  setting=str(agreed.get("auto setting", "")))


def commit_outcome(quorum: Quorum, sizes: Mapping[int, int], votes: Mapping[tuple[int, int], tuple[bool, str]],
                   failed: Mapping[int, str], asked_since: Mapping[int, int] | None = None) -> tuple[bool, str] | None:
    """(committed, why) once the vote of ``quorum`` is decided, else None.

    ``votes``: (group, rank) -> (ok, reason). ``failed``: member groups declared failed -> why.
    ``asked_since``: the exchange each member asked for after voting (only known when a vote
    outlived a coordinator restart: a member that asks for a later exchange was told "commit",
    one that asks for the same exchange again was told "roll back").
    """
    for (g, r), (ok, reason) in sorted(votes.items()):
        if not ok and g in quorum.groups:
            return False, f"group {g} rank {r}: {reason}"
    for g in quorum.groups:
        if g in failed:
            return False, f"group {g} failed: {failed[g]}"
    for g, exchange in sorted((asked_since or {}).items()):
        if g in quorum.groups and exchange > quorum.exchange:
            return True, f"group {g} already moved on to exchange {exchange}"
        if g in quorum.groups and exchange == quorum.exchange:
            return False, f"group {g} is retrying exchange {exchange}"
    if all((g, r) in votes for g in quorum.groups for r in range(sizes[g])):
        return True, "every member finished the collective"
    return None


def blamed(quorum: Quorum, sizes: Mapping[int, int], votes: Mapping[tuple[int, int], tuple[bool, str]],
           failed: Collection[int] = ()) -> set[int]:
    """The members whose votes alone rolled ``quorum`` back. A member said yes when every one of
    its ranks voted yes; any no, or a rank that did not vote, is its no. Members declared failed
    are left aside (they are out already). The no members are blamed when more members said yes
    than no: a failure every member saw (a broken ring) blames nobody, and neither does a split
    (as many each way: ``vote_sides``) nor one most members saw (a lone yes proves nothing)."""
    yes, no = vote_sides(quorum, sizes, votes, failed)
    return no if len(yes) > len(no) else set()


def vote_sides(quorum: Quorum, sizes: Mapping[int, int], votes: Mapping[tuple[int, int], tuple[bool, str]],
               failed: Collection[int] = ()) -> tuple[set[int], set[int]]:
    """(the members that said yes, those that said no) of a quorum's vote, as ``blamed`` counts
    them. As many on each side (a *split*: two groups, one each way) blames nobody: nothing tells
    a member that vetoes from one whose neighbour broke the rings while voting yes."""
    said = {g: all(votes.get((g, r), (False, ""))[0] for r in range(sizes.get(g, 1)))
            for g in quorum.groups if g not in failed}
    return {g for g, ok in said.items() if ok}, {g for g, ok in said.items() if not ok}


def _shares(weights: Mapping[int, float]) -> dict[int, float]:
    """Each group's ``w_g / sum(w)``, computed without overflow (weights up to the largest
    float sum to infinity); empty when no weight is positive."""
    top = max(weights.values(), default=0.0)
    if not top > 0 or not math.isfinite(top):
        if top == math.inf:
            raise ValueError("a contribution weight is infinite")
        return {}
    scaled = {g: w / top for g, w in weights.items()}
    total = math.fsum(scaled.values())
    return {g: w / total for g, w in scaled.items()}


def own_share(weights: Mapping[int, float], group: int) -> float:
    """The part of the weighted mean that is this group's contribution: ``w_g / sum(w)``; 0 for a
    healer, a refused contribution, a group not in the quorum, or no weight at all."""
    return _shares(weights).get(group, 0.0)


def weighted_scale(weights: Mapping[int, float], group: int) -> float:
    """The factor this group multiplies its contribution by, so that the ring's plain mean
    ``sum(x_g) / G`` is the weighted mean ``sum(w_g Δ_g) / sum(w_g)``: ``G · w_g / sum(w)``.
    1.0 exactly when all weights are equal (the unweighted mean, bit for bit); 0 when none."""
    shares = _shares(weights)
    if not shares:
        return 0.0
    if len(set(weights.values())) == 1:
        return 1.0
    return len(weights) * shares.get(group, 0.0)


#: what a group's final summary says about how it ended (``summary_kind``)
TRAINED, STOPPED, LATE = "trained", "stopped", "late"


def summary_kind(summary: dict[str, Any]) -> str:
    """How the group that sent ``summary`` ended: ``LATE`` (it restarted and was told the job had
    finished before it could heal: it holds no model), ``STOPPED`` (its own SIGTERM stopped it, a
    deleted pod: it checkpointed and comes back, so the job is not over), else ``TRAINED`` (it
    trained to the end, or to the stop the job agreed on: it holds the job's model)."""
    if summary.get("joined_late") is True:
        return LATE
    if summary.get("stopped_by"):
        return STOPPED
    return TRAINED


def trained_groups(summaries: dict[int, dict[str, Any]]) -> set[int]:
    """The groups whose summary says they hold the job's final model (``TRAINED``)."""
    return {g for g, s in summaries.items() if summary_kind(s) == TRAINED}


def job_finished(expected_groups: int, summaries: dict[int, dict[str, Any]]) -> bool:
    """True once every one of ``expected_groups`` groups ended for good: it trained to the end or
    joined too late. A group stopped by its own SIGTERM has not: it comes back and resumes."""
    return all(g in summaries and summary_kind(summaries[g]) != STOPPED for g in range(expected_groups))


def job_lost(groups: set[int], failed: set[int], healing: set[int], finished: set[int]) -> bool:
    """True when no group holds the job's state any more: every group of the running job
    (``groups``, those that joined) failed or is a healer (which holds no state until it heals),
    and none finished (``finished``: the groups that trained to the end). A group stopped by its own
    SIGTERM counts as holding it until its restart joins (as a healer). Nothing is left to heal
    from: the job resumes from a checkpoint."""
    if not groups or finished & groups:
        return False
    return all(g in failed or g in healing for g in groups)


def job_lost_message(checkpoint_hint: str = "") -> str:
    """What the coordinator says once ``job_lost``: in its log, its status and to any group that
    comes back. ``checkpoint_hint``: the newest checkpoint it knows of ("" = none known)."""
    where = checkpoint_hint or "the newest checkpoint of each group; the coordinator knows of none"
    return f"job lost: every group failed; resume from checkpoint ({where})"
