"""`diloco run --round-seconds` (issue 32, point 1) with real torchrun groups of two ranks: the
ranks of a group end every round on the same step (rank 0's verdict, broadcast), the job ends after
ceil(--steps / --h) rounds, and the groups' global parameters agree after every round."""

import json

import pytest

from diloco import cli

pytestmark = pytest.mark.slow

SMALL = ["--n-layer", "1", "--n-embd", "64", "--block-size", "32", "--batch-size", "8",
         "--eval-batches", "4", "--warmup-steps", "5", "--no-progress"]


def test_rounds_by_time_in_groups_of_two_ranks(tmp_path):
    out = tmp_path / "summary.json"
    code = cli.main(["run", *SMALL, "--steps", "30", "--h", "10", "--round-seconds", "1.5", "--groups", "2",
                     "--ranks-per-group", "2", "--json", str(out), "--run-dir", str(tmp_path / "run"),
                     "--probe-bytes", "0"])
    assert code == 0
    s = json.loads(out.read_text())
    assert s["outer_rounds"] == 3  # ceil(30 / 10) rounds, however many steps each took
    assert len(s["periods"]) == 3 and sum(s["periods"]) == s["inner_steps"]  # this group's steps per round
    hashes = s["round_hashes_per_group"]
    assert hashes["0"] == hashes["1"] and len(hashes["0"]) == 3
    assert s["params_identical"] and not s["divergence"]
    assert s["eval_loss"] < s["initial_eval_loss"]
