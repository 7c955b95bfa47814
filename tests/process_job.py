"""A real job of processes on 127.0.0.1 for end-to-end fault tests: a ``diloco coordinator`` of two
groups and the torchrun groups started against it, each start logging to its own file."""

import os
import secrets
import signal
import subprocess
import sys
import time

from diloco_helpers import free_port

from diloco.runtime.rank.endpoint import SECRET_ENV, TOKEN_ENV


class Job:
    """A ``diloco coordinator`` of two groups and the torchrun groups started against it; ``close``
    kills whatever still runs (each group's whole session: torchrun and its worker)."""

    def __init__(self, tmp_path, config, *coordinator_args: str) -> None:
        self.tmp_path, self.config, self.port = tmp_path, config, free_port()
        self.env = {**os.environ, SECRET_ENV: secrets.token_hex(32), TOKEN_ENV: secrets.token_hex(8),
                    "OMP_NUM_THREADS": "1"}
        self.coordinator = subprocess.Popen(
            [sys.executable, "-m", "diloco", "coordinator", "--port", str(self.port), "--groups", "2",
             "--heartbeat-timeout", "2", *coordinator_args],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.workers: list[subprocess.Popen] = []

    def log(self, g: int, attempt: int):
        return self.tmp_path / f"group-{g}-{attempt}.log"

    def start_group(self, g: int, attempt: int, *worker_args: str) -> subprocess.Popen:
        """Group ``g``'s ``attempt``-th start (a pod of its Job), logging to ``log(g, attempt)``;
        ``worker_args``: more ``diloco worker`` flags."""
        with open(self.log(g, attempt), "wb") as log:
            w = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                 "-m", "diloco", "worker", "--config", str(self.config), "--group-id", str(g),
                 "--coordinator", f"127.0.0.1:{self.port}", *worker_args],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.workers.append(w)
        return w

    def run(self, group_args: dict[int, list[str]], timeout_s: float) -> tuple[list[int], str, list[str]]:
        """Start every group once (``group_args``: each group's worker flags), wait for them and the
        coordinator, kill what remains: (the groups' exit codes, the coordinator's output, each
        group's log)."""
        try:
            workers = [self.start_group(g, 1, *args) for g, args in sorted(group_args.items())]
            codes = [w.wait(timeout=timeout_s) for w in workers]
            out = self.coordinator.communicate(timeout=60)[0].decode()
        finally:
            self.close()
        return codes, out, [self.log(g, 1).read_text(errors="replace") for g in sorted(group_args)]

    def close(self) -> None:
        for w in self.workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()
        if self.coordinator.poll() is None:
            self.coordinator.kill()
            self.coordinator.communicate()


def wait_for(what: str, ready, timeout_s: float, log) -> None:
    """Poll ``ready`` every 0.2 s; past ``timeout_s`` fail with the tail of ``log``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"{what}: {log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.2)
