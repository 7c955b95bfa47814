"""A sharded (FSDP2) group that dies heals: two groups of 2 ranks with a real coordinator
(``diloco.connect``: quorums, votes), group 1's processes exit mid-job without a goodbye, start
again as a new Gloo world and heal, each rank fetching its shard from the donor's rank holding the
same one; the job ends with every rank of both groups on the same global hash."""

from __future__ import annotations

import time

import pytest
from sharded_helpers import Ranks

from diloco.coordinator import CoordinatorServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STEPS, H, DIE_AT = 24, 4, 11  # group 1 dies in the step that launches the sync at inner step 12


@pytest.mark.parametrize("mode", ["blocking"])
def test_a_killed_sharded_group_heals_and_ends_bit_identical(tmp_path, mode):
    server = CoordinatorServer("127.0.0.1", 0, expected_groups=2, heartbeat_timeout_s=2.0, join_timeout_s=60.0)
    server.start()
    config = dict(mode=mode, steps=STEPS, h=H, inner="synthetic", coordinator=server.address, die_group=1,
                  die_at=DIE_AT, die_delay_s=0.01, dir=str(tmp_path))
    ranks = Ranks(tmp_path, [2, 2], [config])
    try:
        ranks.start(0)
        ranks.start(1)
        deadline = time.monotonic() + 150
        ranks.wait(1, 0, deadline, expect_rc=17)  # died at step DIE_AT
        ranks.start(1, incarnation=1)
        ranks.wait(1, 1, deadline)
        ranks.wait(0, 0, deadline)
        results = ranks.results({1: 1})
    finally:
        ranks.close()
        server.stop()
    survivors = [r[0] for r in results[0]]
    healed = [r[0] for r in results[1]]
    final = survivors[0]["hashes"][-1]
    for rep in survivors + healed:
        assert rep["hashes"][-1] == final  # bit-identical at the end, on every rank
    for rep in healed:
        assert rep["healed"] and rep["start"] > DIE_AT  # it joined mid-job, from the donor's step
        commits = {step: h for step, h in survivors[0]["hashes"][:-1]}
        for step, h in rep["hashes"][:-1]:  # after healing, every commit as the survivors'
            assert commits[step] == h, step
    assert not any(rep["healed"] for rep in survivors)
    print("rollbacks on the survivors:", [rep["rollbacks"] for rep in survivors])
