"""SIGTERM to `diloco run` with job checkpoints on: every group checkpoints at the same step (the
coordinator freezes a stop into one quorum) and the run exits 0, ready for --resume."""

import json
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def test_sigterm_checkpoints_every_group_at_one_step_and_exits_cleanly(tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "run", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
         "--block-size", "32", "--batch-size", "8", "--steps", "100000", "--h", "10", "--groups", "2",
         "--ranks-per-group", "1", "--probe-bytes", "0", "--checkpoint-every", "1000000", "--no-progress",
         "--run-dir", str(tmp_path / "run"), "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not any((tmp_path / "run").glob("group-*.log")) or time.monotonic() < deadline - 110:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        time.sleep(8)  # training under way
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    s = json.loads(out.read_text())
    step = s["stopped_at_step"]
    assert 0 < step < 100000 and step % 10 == 0  # at an exchange: a multiple of H
    folder = tmp_path / "run" / "checkpoints" / f"step-{step:06d}"
    assert sorted(p.name for p in folder.glob("group-*.json")) == ["group-0.json", "group-1.json"]
    assert s["params_identical"]
