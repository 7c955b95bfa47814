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
import signal
import urllib.request

import pytest
from diloco_helpers import free_port, write_small_job
from process_job import Job, wait_for

pytestmark = pytest.mark.slow
STEPS = 200


def training(log) -> bool:
    """The group committed two exchanges (each logs its committed data samples)."""
    return log.exists() and log.read_text(errors="replace").count("committed data samples") >= 2


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
    job = Job(tmp_path, path)
    try:
        first0, group1 = job.start_group(0, 1), job.start_group(1, 1)
        wait_for("group 0 to train", lambda: training(job.log(0, 1)) or first0.poll() is not None, 120, job.log(0, 1))
        assert first0.poll() is None, job.log(0, 1).read_text()[-3000:]
        os.killpg(first0.pid, signal.SIGKILL)  # the pod is gone; group 1 trains on alone
        first0.wait()
        assert group1.wait(timeout=240) == 0, job.log(1, 1).read_text()[-3000:]
        assert job.coordinator.poll() is None  # group 0 has not reported: the job is not over
        again = job.start_group(0, 2)  # its Job's new pod
        assert again.wait(timeout=120) == 0, job.log(0, 2).read_text()[-3000:]
        out = job.coordinator.communicate(timeout=60)[0].decode()
    finally:
        job.close()
    assert "finished before this group could heal" in job.log(0, 2).read_text()
    assert job.coordinator.returncode == 0, out[-3000:]
    assert "joined too late          : group 0" in out and "global params identical  : True" in out
    assert f"inner steps per rank     : {STEPS}" in out


def test_a_group_stopped_by_sigterm_comes_back_as_a_live_member(tmp_path):
    path = tmp_path / "config.json"
    cfg = write_small_job(path, steps=STEPS, ranks_per_group=1)
    cfg.train.checkpoint_every, cfg.train.checkpoint_dir = cfg.sync.h, str(tmp_path / "checkpoints")
    path.write_text(json.dumps(cfg.validate().to_dict()))
    metrics_port = free_port()
    # --min-groups 2: group 0 waits for group 1 at its next exchange, so it cannot finish first
    job = Job(tmp_path, path, "--metrics-port", str(metrics_port), "--min-groups", "2")
    try:
        group0, first1 = job.start_group(0, 1), job.start_group(1, 1)
        wait_for("group 1 to train", lambda: training(job.log(1, 1)), 120, job.log(1, 1))
        os.killpg(first1.pid, signal.SIGTERM)  # kubectl delete pod: torchrun passes it on
        stopped = job.log(1, 1)
        assert first1.wait(timeout=60) != 0, stopped.read_text()[-3000:]  # "restart me", never 0
        assert "stopped at step" in stopped.read_text(errors="replace"), stopped.read_text()[-3000:]
        assert job.coordinator.poll() is None  # the job is not over: group 1 comes back
        again = job.start_group(1, 2)
        wait_for("group 1 to heal", lambda: "healed from group 0" in job.log(1, 2).read_text(errors="replace"), 120,
                 job.log(1, 2))
        wait_for("group 1 to count as live again", lambda: live_groups(metrics_port) == 2, 30, job.log(1, 2))
        assert again.wait(timeout=240) == 0, job.log(1, 2).read_text()[-3000:]
        assert group0.wait(timeout=60) == 0, job.log(0, 1).read_text()[-3000:]
        out = job.coordinator.communicate(timeout=60)[0].decode()
    finally:
        job.close()
    assert job.coordinator.returncode == 0, out[-3000:]
    assert "global params identical  : True" in out and "joined too late" not in out
    assert f"inner steps per rank     : {STEPS}" in out
