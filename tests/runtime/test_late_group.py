"""How a group's end reaches the coordinator when its pod goes (real coordinator and torchrun
processes on 127.0.0.1):

* a group that comes back after the others finished (a pod SIGKILLed near the end, restarted by its
  Job) is told so when it asks to heal, ends with exit 0, and the coordinator's summary leaves it
  out: the job ends cleanly on the groups that trained to the end;
* a group stopped by its own SIGTERM (a deleted pod: it checkpoints, reports, exits 75) has not
  finished: once its restart heals it is a live member again, and the job ends with both groups'
  models in the identical check."""

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from diloco_helpers import free_port, write_small_job

from diloco.runtime.rank.endpoint import SECRET_ENV, TOKEN_ENV

pytestmark = pytest.mark.slow
STEPS = 200


def live_groups(metrics_port: int) -> float | None:
    """The coordinator's diloco_coordinator_live_groups, or None while it cannot be read."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            found = re.search(r"^diloco_coordinator_live_groups (\S+)$", r.read().decode(), re.M)
    except OSError:
        return None
    return float(found.group(1)) if found else None


def test_a_group_restarted_after_the_others_finished_ends_cleanly(tmp_path):
    path = tmp_path / "config.json"
    write_small_job(path, steps=STEPS, ranks_per_group=1)
    port = free_port()
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32), TOKEN_ENV: secrets.token_hex(8), "OMP_NUM_THREADS": "1"}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "diloco", "coordinator", "--port", str(port), "--groups", "2",
         "--heartbeat-timeout", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    workers: list[subprocess.Popen] = []

    def start_group(g: int, attempt: int) -> subprocess.Popen:
        with open(tmp_path / f"group-{g}-{attempt}.log", "wb") as log:
            w = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                 "-m", "diloco", "worker", "--config", str(path), "--group-id", str(g),
                 "--coordinator", f"127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        workers.append(w)
        return w

    try:
        first0, group1 = start_group(0, 1), start_group(1, 1)
        log0 = tmp_path / "group-0-1.log"
        deadline = time.monotonic() + 120
        while log0.read_text(errors="replace").count("committed data samples") < 2:  # joined and training
            assert time.monotonic() < deadline and first0.poll() is None, log0.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(first0.pid, signal.SIGKILL)  # the pod is gone; group 1 trains on alone
        first0.wait()
        assert group1.wait(timeout=240) == 0, (tmp_path / "group-1-1.log").read_text()[-3000:]
        assert coordinator.poll() is None  # group 0 has not reported: the job is not over
        again = start_group(0, 2)  # its Job's new pod
        assert again.wait(timeout=120) == 0, (tmp_path / "group-0-2.log").read_text()[-3000:]
        out = coordinator.communicate(timeout=60)[0].decode()
    finally:
        for w in workers:  # torchrun and its worker: the whole session
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.communicate()
    assert "finished before this group could heal" in (tmp_path / "group-0-2.log").read_text()
    assert coordinator.returncode == 0, out[-3000:]
    assert "joined too late          : group 0" in out and "global params identical  : True" in out
    assert f"inner steps per rank     : {STEPS}" in out


def test_a_group_stopped_by_sigterm_comes_back_as_a_live_member(tmp_path):
    path = tmp_path / "config.json"
    cfg = write_small_job(path, steps=STEPS, ranks_per_group=1)
    cfg.train.checkpoint_every, cfg.train.checkpoint_dir = cfg.sync.h, str(tmp_path / "checkpoints")
    path.write_text(json.dumps(cfg.validate().to_dict()))
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32), TOKEN_ENV: secrets.token_hex(8), "OMP_NUM_THREADS": "1"}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "diloco", "coordinator", "--port", str(port), "--groups", "2",
         "--heartbeat-timeout", "2", "--metrics-port", str(metrics_port),
         "--min-groups", "2"],  # group 0 waits for group 1 at its next exchange: no race with its end
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    workers: list[subprocess.Popen] = []

    def start_group(g: int, attempt: int) -> subprocess.Popen:
        with open(tmp_path / f"group-{g}-{attempt}.log", "wb") as log:
            w = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                 "-m", "diloco", "worker", "--config", str(path), "--group-id", str(g),
                 "--coordinator", f"127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        workers.append(w)
        return w

    def wait_for(what: str, ready, timeout_s: float, log) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert time.monotonic() < deadline, f"{what}: {log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.2)

    try:
        group0, first1 = start_group(0, 1), start_group(1, 1)
        log1 = tmp_path / "group-1-1.log"
        wait_for("group 1 to train", lambda: log1.read_text(errors="replace").count("committed data samples") >= 2,
                 120, log1)
        os.killpg(first1.pid, signal.SIGTERM)  # kubectl delete pod: torchrun passes it on
        assert first1.wait(timeout=60) != 0, log1.read_text()[-3000:]  # "restart me", never 0
        assert "stopped at step" in log1.read_text(errors="replace"), log1.read_text()[-3000:]
        assert coordinator.poll() is None  # the job is not over: group 1 comes back
        again = start_group(1, 2)
        log2 = tmp_path / "group-1-2.log"
        wait_for("group 1 to heal", lambda: "healed from group 0" in log2.read_text(errors="replace"), 120, log2)
        wait_for("group 1 to count as live again", lambda: live_groups(metrics_port) == 2, 30, log2)
        assert again.wait(timeout=240) == 0, log2.read_text()[-3000:]
        assert group0.wait(timeout=60) == 0, (tmp_path / "group-0-1.log").read_text()[-3000:]
        out = coordinator.communicate(timeout=60)[0].decode()
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.communicate()
    assert coordinator.returncode == 0, out[-3000:]
    assert "global params identical  : True" in out and "joined too late" not in out
    assert f"inner steps per rank     : {STEPS}" in out
