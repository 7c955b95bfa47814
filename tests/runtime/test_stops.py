"""Stops that always end: after every signal sequence a user or a scheduler sends ``diloco run``,
no process it started is left (found by an environment marker every one of them inherits), a
graceful stop leaves a checkpoint to resume from, and a stop that cannot finish ends at its deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from diloco_helpers import free_port_range

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MARKER = "DILOCO_TEST_STOP_MARKER"
RUN = ["--steps", "100000", "--h", "5", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
       "--batch-size", "8", "--groups", "2", "--ranks-per-group", "1", "--probe-bytes", "0", "--no-progress"]


def marked(marker: str) -> list[int]:
    """Live processes (zombies excluded) that carry this test's marker in their environment."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"{MARKER}={marker}".encode() in env and state != "Z":
            out.append(int(entry.name))
    return out




class Run:
    """``diloco run`` in its own session (as a shell would start it), marked, with its status port."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.marker = uuid.uuid4().hex
        self.port = free_port_range(3)  # two ranks, then the coordinator's /status
        self.summary = tmp_path / "summary.json"
        self.run_dir = tmp_path / "run"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco", "run", *RUN, "--metrics-port", str(self.port), "--run-dir",
             str(self.run_dir), "--json", str(self.summary), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, MARKER: self.marker},
            start_new_session=True)

    def step(self) -> int:
        try:
            token = (self.run_dir / "coordinator-token").read_text()  # diloco run's /status asks for the job token
            request = urllib.request.Request(f"http://127.0.0.1:{self.port + 2}/status",
                                             headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=2) as r:
                groups = json.load(r)["groups"]
        except OSError:
            return 0
        steps = [int((g.get("progress") or {}).get("step") or 0) for g in groups]
        return min(steps) if len(steps) == 2 else 0

    def wait_training(self, steps: int = 12) -> None:
        deadline = time.monotonic() + 120
        while self.step() < steps:
            assert self.proc.poll() is None, self.proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.3)

    def signal(self, *sigs: int, gap_s: float = 0.1) -> float:
        sent = time.monotonic()
        for i, sig in enumerate(sigs):
            if i:
                time.sleep(gap_s)
            self.proc.send_signal(sig)
        return sent

    def finish(self, timeout: float = 120) -> tuple[int, str, float]:
        output = self.proc.communicate(timeout=timeout)[0]
        return self.proc.returncode, output, time.monotonic()

    def assert_nothing_left(self, ended: float) -> None:
        while (left := marked(self.marker)) and time.monotonic() - ended < 10:
            time.sleep(0.2)
        assert not left, f"processes of the run still alive 10 s after it exited: {left}"

    def kill_everything(self) -> None:  # only if a test failed midway
        for pid in [self.proc.pid, *marked(self.marker)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


@pytest.fixture
def run(tmp_path):
    runs: list[Run] = []

    def start(*extra: str) -> Run:
        runs.append(Run(tmp_path, *extra))
        return runs[-1]

    yield start
    for r in runs:
        if r.proc.poll() is None or marked(r.marker):
            r.kill_everything()


def test_one_ctrl_c_checkpoints_every_group_and_stops(run):
    r = run()
    r.wait_training()
    r.signal(signal.SIGINT)
    code, output, ended = r.finish()
    assert code == 130, output[-3000:]  # interrupted: the job is not finished (0 would say it is)
    assert "SIGINT: every group checkpoints at its next exchange and stops" in output
    assert "exit 130 (interrupted)" in output
    s = json.loads(r.summary.read_text())
    step = s["stopped_at_step"]
    assert step % 5 == 0 and (r.run_dir / "checkpoints" / f"step-{step:06d}" / "group-1.json").is_file()
    assert f"continue: diloco run --resume {r.run_dir / 'checkpoints'}" in output
    r.assert_nothing_left(ended)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_every_process_at_once(run, sig):
    r = run()
    r.wait_training()
    sent = r.signal(sig, sig, gap_s=0.1)
    code, output, ended = r.finish()
    assert code == 130, output[-3000:]
    assert "interrupted; stopped every process it started" in output
    assert ended - sent < 15  # SIGTERM, a short grace, SIGKILL: not a checkpoint's worth of waiting
    r.assert_nothing_left(ended)


def test_sigkill_of_diloco_run_takes_its_whole_tree_with_it(run):
    r = run()
    r.wait_training(steps=2)
    assert len(marked(r.marker)) == 5  # diloco run, 2 group agents, 2 workers
    r.signal(signal.SIGKILL)
    code, _, ended = r.finish()
    assert code == -signal.SIGKILL
    r.assert_nothing_left(ended)


def test_a_graceful_stop_that_cannot_finish_ends_at_its_deadline(run):
    r = run("--stop-timeout", "4")
    r.wait_training()
    group1 = [pid for pid in marked(r.marker)
              if b"--group-id\x001" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert group1
    for pid in group1:  # a frozen datacenter: it can neither checkpoint nor answer
        os.kill(pid, signal.SIGSTOP)
    sent = r.signal(signal.SIGINT)
    code, output, ended = r.finish()
    assert code == 130, output[-3000:]
    assert "the groups did not stop within 4 s of the SIGINT (--stop-timeout) and did not checkpoint" in output
    assert ended - sent < 4 + 3 + 6  # the deadline, the SIGTERM grace, then SIGKILL and the reaping
    r.assert_nothing_left(ended)
