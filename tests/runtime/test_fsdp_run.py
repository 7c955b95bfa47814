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
from diloco.runtime import checkpoint, job_checkpoint, launcher

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
