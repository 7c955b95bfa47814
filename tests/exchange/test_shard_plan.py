"""The plan of a sharded exchange: every element in exactly one ring, rings between the ranks that
hold it, the same rings on every rank of every group, and each rank's share of the bytes."""

from __future__ import annotations

import itertools

import pytest
import torch

from diloco.engine.shard_layout import ShardLayout
from diloco.exchange.shard_plan import shard_exchange_plan

SHAPES = ((13, 8), (13, 1), (7, 13), (7, 1), (5, 7), (5, 1), (1, 3))  # rows, elements per row


def plans_of(sizes: list[int], stripes: int = 2) -> dict[tuple[int, int], object]:
    return {(g, r): shard_exchange_plan(ShardLayout(SHAPES, n, r), sizes, g, stripes)
            for g, n in enumerate(sizes) for r in range(n)}


def global_indices(layout: ShardLayout) -> torch.Tensor:
    """The global index of each element of a rank's shard, in the shard's own order."""
    return torch.cat([torch.arange(a, b) for a, b in layout.pieces()])


@pytest.mark.parametrize("sizes", [[2, 2], [2, 4], [4, 2], [1, 3], [2, 3], [3, 2, 4], [1, 1]])
def test_rings_pair_the_holders_of_the_same_elements_and_cover_everything_once(sizes):
    plans = plans_of(sizes)
    numel = ShardLayout(SHAPES, 1, 0).numel
    rings: dict[int, list] = {}  # stripe index -> (group, rank, global indices it exchanges there)
    for (g, r), plan in plans.items():
        layout = ShardLayout(SHAPES, sizes[g], r)
        order = plan.to_exchange_order(global_indices(layout))  # global index at each exchange position
        assert sorted(order.tolist()) == global_indices(layout).tolist()  # a permutation of the shard
        for s in plan.stripes:
            assert s.ranks[g] == r
            rings.setdefault(s.index, []).append((g, s.ranks, order[s.start:s.stop].tolist()))
    covered = []
    for index, members in rings.items():
        assert sorted(g for g, _, _ in members) == list(range(len(sizes))), index  # one member per group
        assert len({ranks for _, ranks, _ in members}) == 1  # all agree who carries it
        assert all(values == members[0][2] for _, _, values in members)  # the same elements, same order
        covered += members[0][2]
    assert sorted(covered) == list(range(numel))  # every element in exactly one ring


@pytest.mark.parametrize("sizes", [[2, 2], [2, 4], [3, 2, 4]])
def test_each_rank_carries_exactly_its_shard(sizes):
    for (g, r), plan in plans_of(sizes).items():
        held = ShardLayout(SHAPES, sizes[g], r).local_numel()
        assert sum(s.size for s in plan.stripes) == held == plan.numel


def test_equal_sizes_exchange_the_shard_in_place_in_one_cell():
    for (g, r), plan in plans_of([4, 4, 4]).items():
        assert plan.identity
        assert {s.ranks for s in plan.stripes} == {(r, r, r)}
        x = torch.arange(plan.numel, dtype=torch.float32)
        assert plan.to_exchange_order(x) is x and plan.to_shard_order(x) is x


def test_two_ranks_beside_four_meet_on_overlapping_rows():
    plan = shard_exchange_plan(ShardLayout(((8, 2),), 2, 0), [2, 4], 0, stripes_per_cell=1)
    # rank 0 of the 2-rank group holds rows 0..3: rows 0..1 with rank 0 of the other, 2..3 with its rank 1
    assert [(s.ranks, s.start, s.stop) for s in plan.stripes] == [((0, 0), 0, 4), ((0, 1), 4, 8)]
    other = shard_exchange_plan(ShardLayout(((8, 2),), 4, 1), [2, 4], 1, stripes_per_cell=1)
    assert [(s.ranks, s.size) for s in other.stripes] == [((0, 1), 4)]


def test_uneven_layouts_round_trip_their_order():
    for (g, r), plan in plans_of([2, 3]).items():
        x = torch.randn(plan.numel)
        assert torch.equal(plan.to_shard_order(plan.to_exchange_order(x)), x)


def test_bad_arguments_are_refused():
    layout = ShardLayout(SHAPES, 2, 1)
    with pytest.raises(ValueError, match="its size must be"):
        shard_exchange_plan(layout, [4, 2], 0)
    with pytest.raises(ValueError, match="stripes_per_cell"):
        shard_exchange_plan(layout, [2, 2], 0, stripes_per_cell=0)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        ShardLayout(SHAPES, 2, 2)


def test_layout_follows_torch_chunk():
    for rows, size in itertools.product(range(0, 12), range(1, 6)):
        chunks = torch.arange(rows).chunk(size) if rows else ()
        for r in range(size):
            lo, hi = ShardLayout(((rows, 1),), size, r).rows_of(0)
            expected = chunks[r].tolist() if r < len(chunks) else []
            assert list(range(lo, hi)) == expected, (rows, size, r)
