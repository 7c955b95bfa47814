"""A group that comes back after the others finished (a pod SIGKILLed near the end, restarted by
its Job) is told so when it asks to heal, ends with exit 0, and the coordinator's summary leaves it
out: the job ends cleanly on the groups that trained to the end (real coordinator and torchrun
processes on 127.0.0.1)."""

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
from diloco_helpers import free_port, write_small_job

from diloco.runtime.rank.endpoint import SECRET_ENV, TOKEN_ENV

pytestmark = pytest.mark.slow
STEPS = 200


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
        while "round 1" not in log0.read_text(errors="replace"):  # joined and past an exchange
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
