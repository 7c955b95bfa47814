"""Stripe plan: coverage, one rank per group per stripe, balance by bandwidth."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.plan import apportion, stripe_plan


def test_equal_bandwidths_split_evenly() -> None:
    plan = stripe_plan(1000, [[1.0, 1.0], [5.0, 5.0, 5.0, 5.0]], num_stripes=8)
    assert [plan.elements_of(0, r) for r in range(2)] == [500, 500]
    assert [len(plan.stripes_of(1, r)) for r in range(4)] == [2, 2, 2, 2]
    assert plan.stripes_of(0, 0)[0].start == 0 and plan.stripes_of(0, 1)[-1].stop == 1000


def test_proportional_to_bandwidth() -> None:
    plan = stripe_plan(1 << 20, [[10.0, 30.0], [1.0]], num_stripes=64)
    assert [len(plan.stripes_of(0, r)) for r in range(2)] == [16, 48]
    assert len(plan.stripes_of(1, 0)) == 64


def test_zero_bandwidth_rank_carries_nothing() -> None:
    plan = stripe_plan(100, [[0.0, 2.0, 2.0]], num_stripes=4)
    assert plan.stripes_of(0, 0) == [] and plan.elements_of(0, 1) == plan.elements_of(0, 2) == 50


def test_ring_of_a_stripe() -> None:
    plan = stripe_plan(10, [[1.0, 3.0], [1.0]], num_stripes=4)
    addrs = [["a0", "a1"], ["b0"]]
    assert plan.ring(0, addrs) == ["a0", "b0"]
    assert plan.ring(3, addrs, order=[1, 0]) == ["b0", "a1"]


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_elements=-1, rank_bandwidths=[[1.0]], num_stripes=1),
        dict(num_elements=5, rank_bandwidths=[[1.0]], num_stripes=0),
        dict(num_elements=5, rank_bandwidths=[], num_stripes=1),
        dict(num_elements=5, rank_bandwidths=[[]], num_stripes=1),
        dict(num_elements=5, rank_bandwidths=[[0.0, 0.0]], num_stripes=1),
        dict(num_elements=5, rank_bandwidths=[[1.0, -1.0]], num_stripes=1),
        dict(num_elements=5, rank_bandwidths=[[float("nan")]], num_stripes=1),
    ],
)
def test_rejects_bad_input(bad: dict) -> None:
    with pytest.raises(ValueError):
        stripe_plan(**bad)


bandwidths = st.lists(st.floats(0.0, 1e3, allow_nan=False), min_size=1, max_size=6).filter(lambda b: any(x > 0 for x in b))


@given(
    n=st.integers(0, 10_000),
    groups=st.lists(bandwidths, min_size=1, max_size=4),
    num_stripes=st.integers(1, 40),
)
@settings(max_examples=100, deadline=None)
def test_plan_properties(n: int, groups: list[list[float]], num_stripes: int) -> None:
    plan = stripe_plan(n, groups, num_stripes)
    assert len(plan.stripes) == num_stripes
    assert plan.stripes[0].start == 0 and plan.stripes[-1].stop == n
    for a, b in zip(plan.stripes, plan.stripes[1:]):
        assert a.stop == b.start
    for s in plan.stripes:
        assert len(s.ranks) == len(groups)
        for g, r in enumerate(s.ranks):
            assert 0 <= r < len(groups[g]) and groups[g][r] > 0
    for g, bws in enumerate(groups):
        assert sum(len(plan.stripes_of(g, r)) for r in range(len(bws))) == num_stripes
        # Each rank's stripes are contiguous.
        for r in range(len(bws)):
            idx = [s.index for s in plan.stripes_of(g, r)]
            assert idx == list(range(idx[0], idx[0] + len(idx))) if idx else True


@given(st.integers(0, 200), bandwidths)
@settings(max_examples=100, deadline=None)
def test_apportion_is_optimal(k: int, bws: list[float]) -> None:
    counts = apportion(k, bws)
    assert sum(counts) == k
    worst = max(c / b for c, b in zip(counts, bws) if b > 0)
    # No single move of one item from the worst rank to another rank lowers the worst time.
    for r, b in enumerate(bws):
        if b > 0:
            assert (counts[r] + 1) / b >= worst - 1e-12


def test_stripes_reduce_over_their_own_rings() -> None:
    """Two groups (2 and 3 ranks): each stripe runs its own ring; reassembled result = mean of groups."""
    import torch

    from transport_helpers import transports

    n = 10_001
    plan = stripe_plan(n, [[1.0, 3.0], [2.0, 1.0, 1.0]], num_stripes=8)
    group_vec = [torch.randn(n), torch.randn(n)]
    with transports(5, chunk_bytes=1024) as ts:
        addrs = [[ts[0].address, ts[1].address], [ts[2].address, ts[3].address, ts[4].address]]
        members = {(0, 0): ts[0], (0, 1): ts[1], (1, 0): ts[2], (1, 1): ts[3], (1, 2): ts[4]}
        handles = []
        for s in plan.stripes:
            ring = plan.ring(s.index, addrs)
            for g in range(2):
                t = members[(g, s.ranks[g])]
                x = group_vec[g][s.start : s.stop]
                handles.append((g, s, t.all_reduce(x, ring, g, tag=f"r0/s{s.index}")))
        result = [torch.full((n,), float("nan")), torch.full((n,), float("nan"))]
        for g, s, h in handles:
            result[g][s.start : s.stop] = h.wait()
    assert torch.equal(result[0], result[1])
    torch.testing.assert_close(result[0], (group_vec[0] + group_vec[1]) / 2)


def test_aligned_stripes_start_at_multiples_of_the_alignment():
    plan = stripe_plan(10 * 4096 + 100, [[1.0, 1.0], [1.0]], num_stripes=4, align=4096)
    starts = [s.start for s in plan.stripes]
    assert all(a % 4096 == 0 for a in starts) and plan.stripes[-1].stop == 10 * 4096 + 100
    sizes = [s.stop - s.start for s in plan.stripes]  # 11 units of 4096 (the last one short) over 4 stripes
    assert sum(sizes) == 10 * 4096 + 100 and max(sizes) - min(sizes) <= 4096
    small = [(s.start, s.stop) for s in stripe_plan(1000, [[1.0]], num_stripes=3, align=4096).stripes]
    assert [b for b in small if b[0] != b[1]] == [(0, 1000)]  # one stripe holds all
    assert stripe_plan(12, [[1.0]], 3).stripes == stripe_plan(12, [[1.0]], 3, align=1).stripes
