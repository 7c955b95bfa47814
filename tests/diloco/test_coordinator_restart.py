"""The coordinator process is SIGKILLed while two groups train and started again on the same
address: the workers retry, rejoin, finish, and the new coordinator reports the job's summary."""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

from diloco.config import Config
from diloco.connection import SECRET_ENV, TOKEN_ENV

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_workers_survive_a_coordinator_kill_and_restart(tmp_path):
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 32, 2, 32
    cfg.data.batch_size, cfg.data.eval_batches = 8, 2
    cfg.train.steps, cfg.sync.h, cfg.train.log_every = 3000, 10, 50
    cfg.topology.groups, cfg.topology.ranks_per_group = 2, 1
    cfg.transport.timeout_s, cfg.transport.probe_bytes = 5.0, 0
    cfg.fault.heartbeat_timeout = 2.0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.validate().to_dict()))
    port = free_port()
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32), TOKEN_ENV: secrets.token_hex(8), "OMP_NUM_THREADS": "1"}
    coordinator = [sys.executable, "-m", "diloco", "coordinator", "--port", str(port), "--groups", "2",
                   "--heartbeat-timeout", "2"]
    coordinators, workers = [], []
    try:
        first = subprocess.Popen(coordinator, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        coordinators.append(first)
        for g in range(2):
            log = open(tmp_path / f"group-{g}.log", "wb")
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                 "-m", "diloco", "worker", "--config", str(path), "--group-id", str(g),
                 "--coordinator", f"127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
            log.close()
        time.sleep(15)  # joined and training
        assert all(w.poll() is None for w in workers), (tmp_path / "group-0.log").read_text()[-2000:]
        first.kill()
        first.wait()
        time.sleep(2)
        second = subprocess.Popen(coordinator, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        coordinators.append(second)
        codes = [w.wait(timeout=240) for w in workers]
        assert codes == [0, 0], (tmp_path / "group-1.log").read_text()[-3000:]
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
    assert "global params identical  : True" in out and "inner steps per rank     : 3000" in out
    logs = "".join((tmp_path / f"group-{g}.log").read_text() for g in range(2))
    assert "coordinator did not answer" in logs or "report skipped" in logs  # they did see it gone
