"""``diloco run --parallel fsdp``: the demo GPT sharded with FSDP2 in a 2-rank group beside a 1-rank
group, real processes. A run stopped with a job checkpoint and resumed equals a straight run bit for
bit; both groups end on the same global hash; ``--save`` writes the whole global model."""

from __future__ import annotations

import json
import threading

import pytest

from diloco import cli
from diloco.demo.model import GPT, GPTConfig
from diloco.job import config_parse
from diloco.runtime.checkpoints import checkpoint, job_checkpoint
from diloco.runtime.launch import launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SMALL = ["--parallel", "fsdp", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
         "--batch-size", "4", "--eval-batches", "2", "--warmup-steps", "2", "--h", "3", "--groups", "2",
         "--group-sizes", "2,1", "--backend", "gloo", "--probe-bytes", "0", "--threads-per-rank", "1", "--no-progress"]
N = 4  # H = 3: the cut falls mid-round


def test_sharded_groups_stop_resume_and_save_like_a_straight_run(tmp_path):
    def run(*args, name):
        out = tmp_path / f"{name}.json"
        assert cli.main(["run", *args, "--run-dir", str(tmp_path / name), "--json", str(out)]) == 0, \
            (tmp_path / name / "group-0.log").read_text()[-3000:]
        return json.loads(out.read_text())

    straight: dict = {}  # alongside the stopped run: most of a run's wall time is waiting

    def straight_run():
        try:
            args = ["run", *SMALL, "--steps", str(2 * N), "--save", str(tmp_path / "model.pt")]
            cfg = config_parse.from_args(cli.build_parser().parse_args(args))
            straight.update(launcher.run(cfg, run_dir=str(tmp_path / "straight"), progress=False, timeout_s=240))
        except BaseException as e:  # surfaced below
            straight["error"] = e

    thread = threading.Thread(target=straight_run)
    thread.start()
    stopped = run(*SMALL, "--steps", str(2 * N), "--stop-after", str(N), "--checkpoint-every", str(N), name="stopped")
    root = tmp_path / "stopped" / "checkpoints"
    assert stopped["stopped_at_step"] == N and job_checkpoint.complete_steps(root) == [N]
    resumed = run("--resume", str(root), "--no-progress", name="resumed")
    thread.join(240)
    assert "error" not in straight and straight.get("inner_steps") == 2 * N, straight.get("error")
    assert straight["params_identical"] and resumed["params_identical"]
    assert {int(g): h for g, h in resumed["param_hash_per_group"].items()} == straight["param_hash_per_group"]
    assert resumed["eval_loss"] == straight["eval_loss"] < straight["initial_eval_loss"]
    saved = checkpoint.load(tmp_path / "model.pt")  # weights_only; the whole model, gathered from the shards
    whole = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32))
    assert {n: tuple(t.shape) for n, t in saved["global"].items()} == \
        {n: tuple(p.shape) for n, p in whole.named_parameters()}
    assert saved["param_hash"] == straight["param_hash_per_group"][0]


def test_sharded_groups_send_the_last_exchange_with_the_final_codec(tmp_path):
    """--codec int2 --final-codec int8 --residual-decay 0 with a sharded group: every rank of both
    groups switches at the last of 3 exchanges (the log says so once per group, and that no residual
    goes with it), the groups end identical, and the bytes are those of two int2 rounds and one int8
    one."""
    out = tmp_path / "final.json"
    args = [*SMALL, "--h", "5", "--steps", "15", "--codec", "int2", "--final-codec", "int8", "--residual-decay", "0"]
    assert cli.main(["run", *args, "--run-dir", str(tmp_path / "final"), "--json", str(out)]) == 0, \
        (tmp_path / "final" / "group-0.log").read_text()[-3000:]
    s = json.loads(out.read_text())
    assert s["params_identical"] and s["outer_rounds"] == 3 and s["eval_loss"] < s["initial_eval_loss"]
    for g in range(2):
        said = [line for line in (tmp_path / "final" / f"group-{g}.log").read_text().splitlines()
                if "the last exchange" in line]
        assert len(said) == 1 and "round 2, step 15) runs int8 without a residual (--residual-decay 0)" in said[0], said
    # measured: 3.44 bytes/param over both groups (int2 for all three rounds: 1.89)
    assert 2.5 * s["num_parameters"] < s["bytes_sent"] < 4.0 * s["num_parameters"], s["bytes_sent"]
