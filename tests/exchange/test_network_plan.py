"""Bandwidth-driven plans: pure derivation, coordinator pinning, and the averager following them."""

import threading

import pytest
import torch
from diloco_helpers import StaticRing, run_in_threads

from diloco.coordinator import CoordinatorClient, CoordinatorServer
from diloco.exchange.network_plan import (
    BandwidthMonitor,
    CoordinatedPlans,
    equal_plan,
    plan_from_table,
)
from diloco.exchange.striped import StripedAverager
from transport import TcpTransport

MB = 1e6


def test_empty_table_gives_sorted_ring_and_equal_shares():
    plan = equal_plan({0: 2, 1: 3})
    assert plan.ring_order == (0, 1) and plan.rank_bandwidths == ((1.0, 1.0), (1.0, 1.0, 1.0))


def test_ring_avoids_the_slow_link_and_shares_follow_rank_bandwidth():
    fast, slow = 100 * MB, 1 * MB
    table = {
        0: {0: {1: slow, 2: fast}},
        1: {0: {0: fast, 2: fast}, 1: {0: fast / 4, 2: fast / 4}},
        2: {0: {0: fast, 1: fast}},
    }
    plan = plan_from_table(3, {0: 1, 1: 2, 2: 1}, table)
    order = list(plan.ring_order)
    links = list(zip(order, order[1:] + order[:1]))
    assert (0, 1) not in links  # the slow direction is not used
    assert plan.rank_bandwidths[1] == (fast, fast / 4)
    assert plan.version == 3


def test_incomplete_table_falls_back_to_the_equal_plan():
    plan = plan_from_table(1, {0: 1, 1: 2}, {0: {0: {1: 5.0}}, 1: {0: {0: 5.0}}})
    assert plan.rank_bandwidths == ((1.0,), (1.0, 1.0))


def test_coordinated_plans_ask_once_per_block():
    calls = []

    def fetch(exchange):
        calls.append(exchange)
        return len(calls), {}

    plans = CoordinatedPlans(fetch, {0: 1, 1: 1}, every=4)
    versions = [plans(k).version for k in range(9)]
    assert calls == [0, 4, 8] and versions == [1] * 4 + [2] * 4 + [3]


def test_coordinator_versions_complete_tables_and_pins_exchanges():
    with CoordinatorServer(expected_groups=2) as srv:
        addr = srv.address
        clients = [CoordinatorClient(addr, timeout_s=10) for _ in range(3)]
        joins = [threading.Thread(target=c.join, args=(g, r, n, f"127.0.0.1:{7000 + 10 * g + r}"))
                 for c, (g, r, n) in zip(clients, [(0, 0, 1), (1, 0, 2), (1, 1, 2)])]
        for t in joins:
            t.start()
        for t in joins:
            t.join(10)
        c = clients[0]
        assert c.plan(0) == (0, {})
        c.report_bandwidth(0, 0, {1: 5.0})
        c.report_bandwidth(1, 0, {0: 6.0})
        assert c.plan(1)[0] == 0  # group 1 rank 1 has not reported: no new version yet
        c.report_bandwidth(1, 1, {0: 7.0})
        version, table = c.plan(2)
        assert version == 1 and table == {0: {0: {1: 5.0}}, 1: {0: {0: 6.0}, 1: {0: 7.0}}}
        assert c.plan(1)[0] == 0  # exchange 1 stays pinned to the version it was first given
        from diloco.coordinator import CoordinatorError

        with pytest.raises(CoordinatorError, match="not peers"):
            c.report_bandwidth(0, 0, {0: 1.0})
        for cl in clients:
            cl.close()


class SpyTransport:
    """Records the ring of every all-reduce, then runs it on the real transport."""

    def __init__(self, real):
        self.real, self.rings = real, []

    def all_reduce(self, x, ring, index, **kw):
        self.rings.append(list(ring))
        return self.real.all_reduce(x, ring, index, **kw)

    @property
    def bytes_sent(self):
        return self.real.bytes_sent


def test_a_changed_ring_order_is_used_by_the_next_collective():
    G = 3
    real = [TcpTransport(secret=b"k" * 32, timeout_s=20) for _ in range(G)]
    spies = [SpyTransport(t) for t in real]
    ring = StaticRing([t.address for t in real])
    sizes = {g: 1 for g in range(G)}
    orders = {0: (0, 1, 2), 1: (0, 2, 1)}

    def plans(exchange):
        p = equal_plan(sizes)
        return type(p)(exchange, p.groups, orders[exchange], p.rank_bandwidths)

    results = [[None, None] for _ in range(G)]

    def work(g):
        avg = StripedAverager(spies[g], ring, group=g, rank=0, plans=plans, stripes_per_rank=1)
        for k in range(2):
            x = torch.arange(10, dtype=torch.float32) * (g + 1) + k
            results[g][k] = avg.start(x, tag=f"e{k}").wait()

    try:
        run_in_threads(work, G, timeout_s=60)
    finally:
        for t in real:
            t.close()
    addr = [t.address for t in real]
    assert spies[0].rings == [[addr[0], addr[1], addr[2]], [addr[0], addr[2], addr[1]]]
    for k in range(2):
        expected = torch.arange(10, dtype=torch.float32) * 2 + k  # mean of (g+1) over g = 2
        for g in range(G):
            assert torch.equal(results[g][k], results[0][k])
        torch.testing.assert_close(results[0][k], expected)


def test_bandwidth_monitor_runs_in_the_background_and_reports_errors():
    reported = []
    ok = BandwidthMonitor(lambda: {1: 3.0}, reported.append)
    assert ok.refresh()
    ok.join(5)
    assert reported == [{1: 3.0}] and ok.refreshes == 1 and ok.error is None

    def boom():
        raise RuntimeError("peer gone")

    bad = BandwidthMonitor(boom, reported.append)
    bad.refresh()
    bad.join(5)
    assert isinstance(bad.error, RuntimeError)
