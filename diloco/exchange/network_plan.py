"""Which ring order and which stripe split the groups use, from measured bandwidths.

Every rank probes the ranks of the other groups (``transport.probe``) and reports bytes/s to the
coordinator, which versions the whole table and pins a version to each exchange at its first
request. Every rank then derives the same plan from the same table with pure functions:

* a rank's bandwidth is its slowest measured rate to any other group (its NIC's share);
* group i -> group j capacity is the sum of group i's ranks' rates towards j (all NICs at once);
* the ring order maximizes the slowest group-to-group link (``transport.ring_order``);
* the vector's stripes go to each group's ranks in proportion to their bandwidth
  (``transport.stripe_plan``); each stripe runs its own ring across groups.

An empty table (version 0, nothing measured yet) gives sorted ring order and equal shares.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Mapping

from transport import ring_order

Table = Mapping[int, Mapping[int, Mapping[int, float]]]  # group -> rank -> peer group -> bytes/s


@dataclass(frozen=True)
class NetworkPlan:
    version: int
    groups: tuple[int, ...]  # sorted group ids; rank_bandwidths follows this order
    ring_order: tuple[int, ...]  # group ids in ring order
    rank_bandwidths: tuple[tuple[float, ...], ...]  # bytes/s (relative weights) per group, per rank


def plan_from_table(version: int, group_sizes: Mapping[int, int], table: Table) -> NetworkPlan:
    """The plan every rank derives from one bandwidth table (pure)."""
    groups = tuple(sorted(group_sizes))
    complete = all(len(table.get(g, {})) == group_sizes[g] for g in groups) and len(groups) > 1
    if not complete:
        return NetworkPlan(version, groups, groups, tuple((1.0,) * group_sizes[g] for g in groups))
    rank_bw = tuple(
        tuple(min(table[g][r].values(), default=0.0) for r in range(group_sizes[g])) for g in groups
    )
    if any(sum(row) <= 0 for row in rank_bw):
        raise ValueError(f"plan version {version}: some group measured no bandwidth at all: {rank_bw}")
    capacity = [[sum(table[g][r].get(h, 0.0) for r in range(group_sizes[g])) if g != h else 0.0
                 for h in groups] for g in groups]
    order = tuple(groups[i] for i in ring_order(capacity))
    return NetworkPlan(version, groups, order, rank_bw)


def equal_plan(group_sizes: Mapping[int, int]) -> NetworkPlan:
    """Sorted ring, equal shares: what version 0 gives."""
    return plan_from_table(0, group_sizes, {})


class CoordinatedPlans:
    """Plan per exchange from the coordinator, asked once every ``every`` exchanges.

    Exchange k uses the plan pinned for exchange ``k - k % every``, so every rank of every group
    uses the same plan for the same exchange while asking the coordinator rarely.
    """

    def __init__(self, fetch: Callable[[int], tuple[int, Table]], group_sizes: Mapping[int, int], every: int = 8) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self._fetch = fetch
        self._sizes = dict(group_sizes)
        self.every = every
        self._block: int | None = None
        self._plan: NetworkPlan | None = None

    def __call__(self, exchange: int) -> NetworkPlan:
        block = exchange - exchange % self.every
        if block != self._block:
            version, table = self._fetch(block)
            self._plan = plan_from_table(version, self._sizes, table)
            self._block = block
        assert self._plan is not None
        return self._plan


def measure_rates(transport, addresses: Mapping[int, list[str]], group: int, rank: int, nbytes: int) -> dict[int, float]:
    """Probe, for every other group, its rank with this rank's index (or its last): bytes/s."""
    rates = {}
    for peer_group, ranks in sorted(addresses.items()):
        if peer_group != group:
            rates[peer_group] = float(transport.probe(ranks[min(rank, len(ranks) - 1)], nbytes=nbytes))
    return rates


class BandwidthMonitor:
    """Re-measures this rank's rates in a background thread and reports them (one at a time)."""

    def __init__(self, measure: Callable[[], dict[int, float]], report: Callable[[dict[int, float]], None]) -> None:
        self._measure, self._report = measure, report
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.refreshes = 0

    def refresh(self) -> bool:
        """Start a measurement unless one is running; returns whether one was started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._thread = threading.Thread(target=self._run, name="bandwidth-monitor", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        try:
            self._report(self._measure())
            self.refreshes += 1
        except BaseException as e:  # noqa: BLE001 - surfaced through .error and join()
            self.error = e

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
