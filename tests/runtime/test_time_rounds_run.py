"""`diloco run --round-seconds` (issue 32, point 1) with real torchrun groups of two ranks: the
ranks of a group end every round on the same step (rank 0's verdict, broadcast), the job ends after
ceil(--steps / --h) rounds, and the groups' global parameters agree after every round."""

import json

import pytest

from diloco import cli

pytestmark = pytest.mark.slow

SMALL = ["--n-embd", "64", "--block-size", "32", "--batch-size", "8",
         "--eval-batches", "4", "--warmup-steps", "5", "--no-progress"]


@pytest.mark.parametrize("sync", [[], ["--mode", "overlap", "--fragments", "2", "--overlap-steps", "1"]],
                         ids=["blocking", "overlap-2-fragments"])
def test_rounds_by_time_in_groups_of_two_ranks(tmp_path, sync):
    """Overlap with 2 fragments: rank 0's verdict is a mask of the fragments whose round ends."""
    out = tmp_path / "summary.json"
    code = cli.main(["run", *SMALL, "--n-layer", "2", "--steps", "30", "--h", "10", "--round-seconds", "1.5",
                     "--groups", "2", "--ranks-per-group", "2", "--backend", "gloo", "--json", str(out), "--run-dir", str(tmp_path / "run"),
                     "--probe-bytes", "0", *sync])
    assert code == 0
    s = json.loads(out.read_text())
    fragments = 2 if sync else 1
    assert s["outer_rounds"] == 3 * fragments  # ceil(30 / 10) rounds of each fragment, however many steps each took
    assert len(s["periods"]) == 3  # group 0's steps in each round of fragment 0
    # with 2 fragments the last round of fragment 1 ends half a round after fragment 0's
    assert sum(s["periods"]) == s["inner_steps"] if fragments == 1 else sum(s["periods"]) < s["inner_steps"]
    hashes = s["round_hashes_per_group"]
    assert hashes["0"] == hashes["1"] and len(hashes["0"]) == 3 * fragments
    assert s["params_identical"] and not s["divergence"]
    assert s["eval_loss"] < s["initial_eval_loss"]
