"""Membership: who the peers are, as every rank of every group receives it from the coordinator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Membership:
    """The complete quorum of one epoch.

    ``members`` maps a group id to the data-plane addresses (``host:port``) of its ranks, indexed
    by rank. ``ring`` is the order of groups in the cross-group ring. ``epoch`` counts the times a
    complete membership was formed (1 for the first).
    """

    epoch: int
    members: Mapping[int, tuple[str, ...]]
    ring: tuple[int, ...]
    heal: bool = False  # joined while the job ran: fetch the job's state before taking part
    setting: str = ""  # --codec/--h auto: the setting of the job's latest quorum ("" none yet, or no auto)
    resume_step: int = -1  # the job checkpoint step the job started from (-1: none); a group behind it heals

    @property
    def groups(self) -> list[int]:
        """Group ids, sorted."""
        return sorted(self.members)

    @property
    def ring_order(self) -> list[int]:
        """Group ids in ring order."""
        return list(self.ring)

    def ranks(self, group: int) -> list[str]:
        """Data-plane addresses of ``group``'s ranks, indexed by rank; KeyError if unknown."""
        return list(self.members[group])

    def group_size(self, group: int) -> int:
        """Number of ranks in ``group``."""
        return len(self.members[group])

    def address(self, group: int, rank: int) -> str:
        """Data-plane address of one rank."""
        return self.members[group][rank]
