"""What fault tolerance did on one rank: exchanges committed, rolled back, healed, and their stalls."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MAX_EXCHANGES_KEPT = 2000  # per-exchange lists keep the last this many


@dataclass
class FaultStats:
    """What fault tolerance did on this rank (seconds are wall time)."""

    committed: int = 0  # exchanges committed
    rollbacks: int = 0  # attempts of exchanges that were rolled back and retried
    retried_exchanges: int = 0  # exchanges that needed more than one attempt
    failures_seen: int = 0  # exchanges run by fewer groups than the one before (a member was lost)
    # wall time, from asking for the quorum to the commit, of each exchange a failure disturbed
    # (retried, or run by fewer groups than the one before); the last MAX_EXCHANGES_KEPT
    stall_seconds: list[float] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)  # this group's refused contributions (why)
    healed: bool = False
    heal_seconds: float = 0.0
    heals_served: int = 0
    quorum_sizes: list[int] = field(default_factory=list)  # groups of each committed exchange
    rejoins: int = 0  # times this rank rejoined a restarted coordinator
    aborted_lost: int = 0  # rings aborted because the coordinator said a member of their quorum was lost
    caught_up: int = 0  # exchanges the grace window left this group out of, whose mean it took at weight 0
    catch_ups_served: int = 0  # committed means this rank sent to a left-out group as the donor
    disagreements: int = 0  # asks answered "the members differ with no majority: ask again"
    # the last MAX_EXCHANGES_KEPT exchanges: [exchange, seconds from asking to commit, attempts, groups]
    exchanges: list[list[float]] = field(default_factory=list)

    def record(self, exchange: int, seconds: float, attempts: int, groups: int) -> None:
        """A committed exchange: ``seconds`` from asking to commit, ``groups`` in its quorum."""
        shrank = bool(self.quorum_sizes) and groups < self.quorum_sizes[-1]
        self.committed += 1
        self.failures_seen += shrank
        if attempts > 1:
            self.retried_exchanges += 1
        if attempts > 1 or shrank:
            self.stall_seconds.append(round(seconds, 4))
        self.quorum_sizes.append(groups)
        self.exchanges.append([exchange, round(seconds, 4), attempts, groups])
        for kept in (self.quorum_sizes, self.exchanges, self.stall_seconds):
            del kept[:-MAX_EXCHANGES_KEPT]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
