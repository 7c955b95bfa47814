"""Test scaffolding shared by the diloco tests: simulated groups in threads, a static ring."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")


def run_in_threads(work: Callable[[int], None], n: int, timeout_s: float = 120.0) -> None:
    """Run ``work(i)`` for i in 0..n-1 in threads (one per simulated group); re-raise failures."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a simulated group did not finish"
    assert not errors, errors


def build_in_threads(make: Callable[[int], T], n: int, timeout_s: float = 120.0) -> list[T]:
    """``[make(i) for i in range(n)]`` with each call in its own thread: engines agree on their
    initial parameters with the other groups while they are built, so they must be built at once."""
    out: list = [None] * n

    def work(i: int) -> None:
        out[i] = make(i)

    run_in_threads(work, n, timeout_s)
    return out


class StaticRing:
    """Membership of single-rank groups, in the shape the averager reads."""

    def __init__(self, addresses: list[str]) -> None:
        self.groups = list(range(len(addresses)))
        self.ring_order = list(self.groups)
        self._addresses = addresses

    def ranks(self, group: int) -> list[str]:
        return [self._addresses[group]]


def write_small_job(path, *, steps: int, ranks_per_group: int, groups: int = 2):
    """A job config small enough for multi-process fault tests (1-layer demo GPT, H=10, 5 s
    collective deadline, 2 s heartbeat timeout, every rank on the CPU with gloo, whatever GPUs the
    host has), written as JSON to ``path``; returns the Config."""
    import json

    from diloco.job.config import Config

    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 32, 2, 32
    cfg.data.batch_size, cfg.data.eval_batches = 8, 2
    cfg.train.steps, cfg.sync.h, cfg.train.log_every = steps, 10, 50
    cfg.topology.groups, cfg.topology.ranks_per_group = groups, ranks_per_group
    cfg.topology.backend = "gloo"
    cfg.transport.timeout_s, cfg.transport.probe_bytes = 5.0, 0
    cfg.fault.heartbeat_timeout = 2.0
    path.write_text(json.dumps(cfg.validate().to_dict()))
    return cfg


@contextlib.contextmanager
def position_records() -> Iterator[list[logging.LogRecord]]:
    """The records ``diloco.exchange.data_positions`` logs inside the block (INFO and up)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("diloco.exchange.data_positions")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port_range(n: int = 1) -> int:
    """A base port on 127.0.0.1 with ``n`` free ports from it, below the kernel's ephemeral range
    (``net.ipv4.ip_local_port_range``): the kernel never hands a port there to another process's
    ``bind(0)`` or ``connect`` (a test running beside this one) between this check and its use,
    as it could a port it gave out once and took back."""
    low, high = _ephemeral_range()
    floor = 10000
    if low - floor < 1000:  # the ephemeral range starts too low: from above it instead
        floor, low = high + 1, 65536
    if low - n <= floor:
        raise RuntimeError(f"no ports outside the ephemeral range {low}-{high}")
    pick = random.Random()  # not the tests' seeded global one: xdist's workers would draw alike
    for _ in range(200):
        base = pick.randrange(floor, low - n)
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} free ports from {floor} to {low}")


def free_port() -> int:
    """A free port on 127.0.0.1 outside the ephemeral range (``free_port_range``)."""
    return free_port_range(1)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def run_api_example(script: Path, args: list[str], *, groups: int = 2, timeout_s: float = 120.0
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run an example of the Python API (``script``, one process per group, ``--group g`` added to
    ``args``) against a coordinator of this process; asserts every process exited 0. Returns each
    group's last stdout line as JSON, and the coordinator's final snapshot. One intra-op thread
    per process, as ``diloco run`` gives each worker: torch's default (every core) in two processes
    on a 2-core host makes tiny steps take most of a test."""
    from diloco.coordinator import CoordinatorServer

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "DILOCO_SECRET": secrets.token_hex(32), "DILOCO_TOKEN": "t0ken", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with CoordinatorServer(expected_groups=groups, token="t0ken") as server:
        procs = [subprocess.Popen([sys.executable, str(script), "--coordinator", server.address, "--group", str(g),
                                   *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for g in range(groups)]
        try:
            outs = [p.communicate(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                p.kill()
        assert [p.returncode for p in procs] == [0] * groups, [o[1][-2000:] for o in outs]
        snapshot = server.snapshot()
    return [json.loads(o[0].strip().splitlines()[-1]) for o in outs], snapshot
