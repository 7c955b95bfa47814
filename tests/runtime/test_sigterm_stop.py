"""SIGTERM to `diloco run` with job checkpoints on: every group checkpoints at the same step (the
coordinator freezes a stop into one quorum) and the run exits 130 (interrupted), ready for
--resume. When the signal comes while the groups start, nothing was trained: the run stops at
once, without a checkpoint, and exits 130."""

import json
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "8",
        "--h", "10", "--groups", "2", "--ranks-per-group", "1", "--probe-bytes", "0", "--no-progress"]


def _training(run_dir) -> bool:
    """Both groups committed two exchanges: each reported its steps to the coordinator (a report
    goes with every exchange), so the run knows that training is under way."""
    logs = sorted(run_dir.glob("group-*.log"))
    return len(logs) == 2 and all(p.read_text(errors="replace").count("committed data samples") >= 2 for p in logs)


@pytest.mark.parametrize("when", ["training", "starting"])
def test_sigterm_checkpoints_every_group_at_one_step_and_exits_cleanly(tmp_path, when):
    out, run_dir = tmp_path / "summary.json", tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "run", *TINY, "--steps", "100000", "--checkpoint-every", "1000000",
         "--run-dir", str(run_dir), "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (_training(run_dir) if when == "training" else any(run_dir.glob("group-*.log"))):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output[-3000:]
    if when == "starting":  # nothing trained: no checkpoint to wait for
        assert time.monotonic() - sent < 15, output[-3000:]
        assert "nothing was trained yet, so no checkpoint is needed; stopping now" in output
        assert not out.exists() and not list((run_dir / "checkpoints").glob("step-*"))
        return
    s = json.loads(out.read_text())
    step = s["stopped_at_step"]
    assert 0 <= step < 100000 and step % 10 == 0, output[-3000:]  # at an exchange: a multiple of H
    assert step > 0
    folder = run_dir / "checkpoints" / f"step-{step:06d}"
    assert sorted(p.name for p in folder.glob("group-*.json")) == ["group-0.json", "group-1.json"]
    assert s["params_identical"]
    # the checkpoint resumes
    resumed = tmp_path / "resumed.json"
    done = subprocess.run(
        [sys.executable, "-m", "diloco", "run", "--resume", str(run_dir / "checkpoints"), "--stop-after",
         str(step + 10), "--no-progress", "--run-dir", str(tmp_path / "run2"), "--json", str(resumed)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert done.returncode == 0, done.stdout.decode()[-3000:]
    r = json.loads(resumed.read_text())
    assert r["resumed_at_step"] == step and r["stopped_at_step"] == step + 10 and r["params_identical"]
