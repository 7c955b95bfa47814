"""Quorum rules as pure functions: admission, completeness, ring order, liveness, divergence.

``members`` is always ``{group: {rank: address}}`` and ``sizes`` is ``{group: group_size}`` for
every group with at least one joined rank. Nothing here keeps state, takes locks or reads a clock.
"""

from __future__ import annotations

import enum
from typing import Hashable, Iterable, Mapping, TypeVar

Members = Mapping[int, Mapping[int, str]]
K = TypeVar("K", bound=Hashable)


class QuorumError(Exception):
    """A request the quorum rules refuse; ``code`` is a gRPC status name. ``halted``: the job is
    halted (an error no restart mends: the server says so in the ``diloco-halted`` trailer)."""

    def __init__(self, code: str, message: str, *, halted: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.halted = halted


class Admission(enum.Enum):
    """How a join changes the membership."""

    NEW = "new"          # a rank not seen before
    SAME = "same"        # the same rank with the same address again (a restart or a retry)
    REPLACE = "replace"  # the same rank with a new address, allowed only before the quorum forms


def admit(members: Members, sizes: Mapping[int, int], expected_groups: int, max_group_size: int,
          group: int, rank: int, group_size: int, address: str, *, may_replace: bool) -> Admission:
    """Decide whether ``(group, rank)`` at ``address`` may join; raise QuorumError if not.

    ``may_replace`` says whether a different address may take over this rank's slot (the caller
    allows it only before the quorum formed and while no join of the old address is waiting).
    """
    if not 0 <= group < expected_groups:
        raise QuorumError("INVALID_ARGUMENT",
                          f"group {group} is out of range: this coordinator expects groups "
                          f"0..{expected_groups - 1}")
    if group_size > max_group_size:
        raise QuorumError("INVALID_ARGUMENT",
                          f"group_size {group_size} exceeds this coordinator's max_group_size="
                          f"{max_group_size}")
    if not 0 <= rank < group_size:
        raise QuorumError("INVALID_ARGUMENT",
                          f"rank {rank} is out of range for group_size {group_size}")
    known = sizes.get(group)
    if known is not None and known != group_size:
        raise QuorumError("FAILED_PRECONDITION",
                          f"group {group} was joined with group_size {known}; rank {rank} says "
                          f"{group_size}")
    for other_group, ranks in members.items():
        for other_rank, other_address in ranks.items():
            if other_address == address and (other_group, other_rank) != (group, rank):
                raise QuorumError("FAILED_PRECONDITION",
                                  f"address {address} is already used by group {other_group} "
                                  f"rank {other_rank}")
    current = members.get(group, {}).get(rank)
    if current is None:
        return Admission.NEW
    if current == address:
        return Admission.SAME
    if may_replace:
        return Admission.REPLACE
    raise QuorumError("FAILED_PRECONDITION",
                      f"group {group} rank {rank} already joined with address {current}, not "
                      f"{address} (a rank cannot change its address once the quorum formed or "
                      f"while its earlier join is still waiting)")


def missing(members: Members, sizes: Mapping[int, int],
            expected_groups: int) -> dict[int, list[int] | None]:
    """Members still to join: ``{group: [missing ranks]}``, or ``{group: None}`` for a group with
    no rank yet (its size is unknown). Empty when the quorum is complete."""
    out: dict[int, list[int] | None] = {}
    for group in range(expected_groups):
        if group not in sizes:
            out[group] = None
            continue
        joined = members.get(group, {})
        absent = [r for r in range(sizes[group]) if r not in joined]
        if absent:
            out[group] = absent
    return out


def is_complete(members: Members, sizes: Mapping[int, int], expected_groups: int) -> bool:
    """True when every expected group has all its ranks joined."""
    return not missing(members, sizes, expected_groups)


def describe_missing(absent: Mapping[int, list[int] | None], sizes: Mapping[int, int]) -> str:
    """Human-readable list of missing members, e.g. ``group 0 ranks [1] of 2; group 1: no rank``."""
    parts = []
    for group, ranks in sorted(absent.items()):
        if ranks is None:
            parts.append(f"group {group}: no rank joined")
        else:
            parts.append(f"group {group}: ranks {ranks} of {sizes[group]}")
    return "; ".join(parts) if parts else "nothing"


def ring_order(groups: Iterable[int]) -> list[int]:
    """Order of groups in the cross-group ring. Sorted ids for now; a bandwidth-aware order
    (from probes) replaces this later without changing callers."""
    return sorted(set(groups))


def stale(last_heard: Mapping[K, float], now: float, timeout_s: float) -> list[K]:
    """Keys whose last message (seconds, same clock as ``now``) is more than ``timeout_s`` old."""
    return [key for key, seen in last_heard.items() if now - seen > timeout_s]


def diverged(hashes: Mapping[int, str]) -> bool:
    """True when groups reported different parameter hashes for the same round."""
    return len(set(hashes.values())) > 1
