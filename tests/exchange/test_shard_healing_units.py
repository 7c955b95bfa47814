"""The pure parts of healing a sharded group: which shard it joins with, and what it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from diloco.engine.shard_layout import ShardLayout
from diloco.exchange.shard_healing import healing_layout, refuse_other_sizes, sharded_check

LAYOUTS = [ShardLayout(((4, 3),), 2, 1), ShardLayout(((6, 1), (2, 2)), 2, 1)]
SHARDED = SimpleNamespace(sharded=SimpleNamespace(layouts=LAYOUTS))
UNSHARDED = SimpleNamespace(sharded=None)


def quorum(sizes: dict[int, int], donor: int) -> SimpleNamespace:
    return SimpleNamespace(members={g: [f"h{g}:{r}" for r in range(n)] for g, n in sizes.items()}, donor=donor)


def test_a_healer_joins_with_its_own_shard_of_the_exchanged_fragment():
    assert healing_layout(SHARDED, "f1/r7") is LAYOUTS[1]
    assert healing_layout(SHARDED, "f0/final") is LAYOUTS[0]
    assert healing_layout(UNSHARDED, "f0/r1") is None
    assert sharded_check(UNSHARDED, quorum({0: 1}, 0)) is None
    with pytest.raises(ValueError, match="not a fragment sync"):
        healing_layout(SHARDED, "f2/r0")
    with pytest.raises(ValueError, match="not a fragment sync"):
        healing_layout(SHARDED, "init/check")


def test_a_sharded_group_heals_only_from_a_group_of_its_size():
    refuse_other_sizes(SHARDED, quorum({0: 2, 1: 2}, donor=0), group=1)  # same size: fine
    refuse_other_sizes(UNSHARDED, quorum({0: 4, 1: 2}, donor=0), group=1)  # DDP: any size
    with pytest.raises(ValueError, match=r"group 1 \(2 ranks, sharded\) cannot heal from group 0 \(4 ranks\)"):
        refuse_other_sizes(SHARDED, quorum({0: 4, 1: 2}, donor=0), group=1)
