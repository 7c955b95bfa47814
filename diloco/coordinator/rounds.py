"""Quorum per round, the commit vote and the contribution screen: pure decisions.

Every exchange between groups (an outer round, or one fragment's sync in streaming modes) runs
among a *quorum* the coordinator hands out. These functions decide, from what the groups asked and
voted, who is in it, with which weights, and whether its result may be applied. Nothing here
keeps state, takes locks or reads a clock, so every rule is tested without processes.

Rules (docs/fault_tolerance.md):

* a quorum for exchange E forms once every live group (joined, not failed, not healing) has asked
  for a quorum, and at least ``min_groups`` groups are in it; groups that asked to heal join the
  next quorum that forms. E is the job's next exchange; a group that asks for another one is out
  of step and is sent to heal;
* with a grace window (``grace_s`` > 0), the quorum also forms once ``grace_s`` seconds passed
  since the first group asked for this attempt of E, with the groups that asked by then (still at
  least ``min_groups``): the live groups that had not asked are *left out* (``Quorum.left_out``);
  once E commits without them they are out of step, lose their round's work and heal. A group
  that healed in an earlier exchange and has not asked for a later one yet is waited for past the
  window while it is heard from (``patient_groups``): it trains its first round only once its
  state transfer ended, and cutting it would only send it to heal again;
* the non-healing members must agree on the exchange's tag and size, on the hash of the global
  state they start from and (``--codec/--h auto``) on the setting they run: a member in the
  minority is *evicted* (stopped and healed), never averaged;
* weights: a member's weight is what it contributed since its last exchange (tokens, or inner
  steps x ranks); healers and rejected contributions weigh 0. The mean is the weighted mean;
* a contribution is *rejected* if its norm is NaN/Inf, or larger than ``factor`` times the median
  of the group's last accepted norms (once ``min_history`` are known; ``factor`` 0 turns this off);
* a quorum's result is applied (committed) only if every rank of every member voted that its
  collective finished; any failed vote, or a member declared failed, rolls it back on everyone.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

HEAL = -1  # the exchange a group asks for when it needs the job's state first


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


def _majority(values: Mapping[int, object]) -> object:
    """The most common value; ties go to the value of the lowest group id."""
    counts = Counter(values.values())
    best = max(counts.values())
    return next(values[g] for g in sorted(values) if counts[values[g]] == best)


def grace_over(waited_s: float | None, grace_s: float) -> bool:
    """True once an exchange's grace window has ended: ``grace_s`` > 0 (0 = no window: wait for
    every live group) and ``waited_s`` (seconds since the first group asked for this attempt, None
    before any asked) reached it."""
    if grace_s < 0 or not math.isfinite(grace_s):
        raise ValueError(f"grace_s must be a finite number of seconds >= 0 (0: off), got {grace_s}")
    return grace_s > 0 and waited_s is not None and waited_s >= grace_s


def patient_groups(healed_at: Mapping[int, int], exchange: int, silent_s: Mapping[int, float],
                   limit_s: float) -> set[int]:
    """The groups a grace window does not cut from ``exchange``: healed in an earlier exchange
    (``healed_at``: group -> that exchange, kept until the group asks for a later one) and heard
    from (every rank) within ``limit_s`` seconds (``silent_s``: group -> its longest silence), so
    still alive and fetching its state rather than dead."""
    return {g for g, e in healed_at.items() if e < exchange and silent_s.get(g, float("inf")) <= limit_s}


def decide(asks: Mapping[int, Ask], live: set[int], *, next_exchange: int | None, min_groups: int,
           attempt: int, quorum_id: str, rejected: Mapping[int, str] | None = None,
           waited_s: float | None = None, grace_s: float = 0.0,
           patient: Collection[int] = ()) -> Quorum | None:
    """The quorum to hand out now, or None while it must wait.

    ``asks``: the groups every rank of which asked (HEAL for healers). ``live``: the groups that
    count as members (joined, not failed, not healing) — a live group that has not asked is waited
    for, until the grace window ends (``grace_over(waited_s, grace_s)``; ``waited_s``: seconds
    since the first group asked for this attempt); it is then left out (``Quorum.left_out``),
    unless it is ``patient`` (waited for regardless of the window).
    ``next_exchange``: the job's next exchange (None after a coordinator restart: the one most
    groups ask for, the latest on a tie). ``attempt``: how many quorums this exchange had before.
    ``rejected``: contributions the caller's screen refused (group -> reason).
    """
    missing = sorted(g for g in live if g not in asks)
    if missing and (not grace_over(waited_s, grace_s) or any(g in patient for g in missing)):
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
    shape = _majority({g: (a.tag, a.numel) for g, a in current.items()})
    for g, a in current.items():
        if (a.tag, a.numel) != shape:
            evicted[g] = f"asked for {a.tag!r} of {a.numel} elements, the others for {shape[0]!r} of {shape[1]}"
    hashes = {g: a.state_hash for g, a in current.items() if g not in evicted and a.state_hash}
    agreed = str(_majority(hashes)) if hashes else ""
    for g, h in hashes.items():
        if h != agreed:
            evicted[g] = f"global state hash {h} differs from the quorum's {agreed}"
    settings = {g: a.setting for g, a in current.items() if g not in evicted and a.setting}
    setting = str(_majority(settings)) if settings else ""
    for g, s in settings.items():
        if s != setting:
            evicted[g] = f"runs the auto setting {s!r}, the quorum {setting!r}"
    members = sorted(g for g in current if g not in evicted)
    healable = all(current[g].healable for g in members)
    healers = sorted(g for g, a in asks.items() if a.exchange == HEAL) if healable else []
    if not members or len(members) + len(healers) < min_groups:
        return None
    refused = {g: r for g, r in (rejected or {}).items() if g in members}
    weights = {g: (0.0 if g in refused else float(current[g].weight)) for g in members}
    weights.update({g: 0.0 for g in healers})
    tag, numel = shape  # type: ignore[misc]
    return Quorum(id=quorum_id, exchange=exchange, attempt=attempt, tag=str(tag), numel=int(numel),
                  groups=tuple(sorted(members + healers)), weights=weights, healers=tuple(healers),
                  donor=members[0] if healers else -1, rejected=refused, evicted=evicted,
                  state_hash=agreed, left_out=tuple(missing), setting=setting)


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


def own_share(weights: Mapping[int, float], group: int) -> float:
    """The part of the weighted mean that is this group's contribution: ``w_g / sum(w)``; 0 for a
    healer, a refused contribution, a group not in the quorum, or no weight at all."""
    total = sum(weights.values())
    if total <= 0 or group not in weights:
        return 0.0
    return weights[group] / total


def weighted_scale(weights: Mapping[int, float], group: int) -> float:
    """The factor this group multiplies its contribution by, so that the ring's plain mean
    ``sum(x_g) / G`` is the weighted mean ``sum(w_g Δ_g) / sum(w_g)``: ``G · w_g / sum(w)``.
    1.0 exactly when all weights are equal (the unweighted mean, bit for bit); 0 when none."""
    total = sum(weights.values())
    if total <= 0:
        return 0.0
    values = set(weights.values())
    if len(values) == 1:
        return 1.0
    return len(weights) * weights[group] / total


def job_lost(groups: set[int], failed: set[int], healing: set[int], finished: set[int]) -> bool:
    """True when no group holds the job's state any more: every group of the running job
    (``groups``, those that joined) failed or is a healer (which holds no state until it heals),
    and none finished. Nothing is left to heal from: the job resumes from a checkpoint."""
    if not groups or finished & groups:
        return False
    return all(g in failed or g in healing for g in groups)


def job_lost_message(checkpoint_hint: str = "") -> str:
    """What the coordinator says once ``job_lost``: in its log, its status and to any group that
    comes back. ``checkpoint_hint``: the newest checkpoint it knows of ("" = none known)."""
    where = checkpoint_hint or "the newest checkpoint of each group; the coordinator knows of none"
    return f"job lost: every group failed; resume from checkpoint ({where})"
