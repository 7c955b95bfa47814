"""The coordinator process is SIGKILLed while two groups train and started again on the same
address: the workers retry, rejoin, finish, and the new coordinator reports the job's summary."""

import os
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
STEPS = 600


def group_steps(metrics_port: int) -> list[float]:
    """The inner step each group last reported, from the coordinator's metrics ([] if unreachable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return []
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("diloco_coordinator_group_step{")]


def test_workers_survive_a_coordinator_kill_and_restart(tmp_path):
    path = tmp_path / "config.json"
    # the groups wait at their next exchange while no coordinator answers: 600 steps leave ~500 after
    # the kill (at step 100), ~8 s of training on 2 idle cores, to rejoin and finish
    write_small_job(path, steps=STEPS, ranks_per_group=1)
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32), TOKEN_ENV: secrets.token_hex(8), "OMP_NUM_THREADS": "1"}
    coordinator = [sys.executable, "-m", "diloco", "coordinator", "--port", str(port), "--groups", "2",
                   "--heartbeat-timeout", "2"]
    coordinators, workers = [], []
    try:
        first = subprocess.Popen(coordinator + ["--metrics-port", str(metrics_port)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        coordinators.append(first)
        for g in range(2):
            log = open(tmp_path / f"group-{g}.log", "wb")
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                 "-m", "diloco", "worker", "--config", str(path), "--group-id", str(g),
                 "--coordinator", f"127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
            log.close()
        deadline = time.monotonic() + 120
        while not (len(steps := group_steps(metrics_port)) == 2 and min(steps) >= 100):  # joined and training
            assert time.monotonic() < deadline, f"the groups did not start training: steps {steps}"
            time.sleep(0.2)
        assert all(w.poll() is None for w in workers), (tmp_path / "group-0.log").read_text()[-2000:]
        first.kill()
        first.wait()
        time.sleep(2)
        second = subprocess.Popen(coordinator, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        coordinators.append(second)
        codes = [w.wait(timeout=240) for w in workers]
        assert codes == [0, 0], "\n".join(_log_tail(tmp_path / f"group-{g}.log") for g, c in enumerate(codes) if c)
        out = second.communicate(timeout=60)[0].decode()
    finally:
        for w in workers:  # torchrun and its worker: the whole session
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()
        for c in coordinators:
            if c.poll() is None:
                c.kill()
                c.wait()
    assert second.returncode == 0, out[-3000:]
    assert "global params identical  : True" in out and f"inner steps per rank     : {STEPS}" in out
    logs = "".join((tmp_path / f"group-{g}.log").read_text() for g in range(2))
    # they did see it gone: a call failed while it was down, or the new one did not know them
    assert any(seen in logs for seen in ("coordinator did not answer", "report skipped", "rejoined the coordinator"))


def _log_tail(path, chars: int = 3000) -> str:
    """The end of a group's log without its per-exchange sample lines (they crowd out the error)."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if "data_positions" not in line]
    return f"{path.name}:\n" + "\n".join(lines)[-chars:]
