"""``kill -USR1``: a diloco process writes its threads' stacks to its log and runs on; ``diloco
torchrun`` (PID 1 of a worker pod) passes the signal on to its workers. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.runtime.ops import stack_dumps

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "diloco", *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = log.read_text(errors="replace")
        if text in got:
            return got
        assert proc.poll() is None, f"the process ended (exit {proc.returncode}) before {text!r}:\n{got[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} within {timeout_s:g} s:\n{log.read_text(errors='replace')[-3000:]}")


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


COORDINATOR = ["coordinator", "--host", "127.0.0.1", "--port", "0", "--groups", "1"]


def test_install_takes_fd_2_whatever_sys_stderr_is(capsys):
    """``diloco.cli.main`` installs the dump in-process too (tests, a user's script), where
    sys.stderr may be an object without a file descriptor (capsys's): the dump goes to fd 2."""
    import faulthandler

    with pytest.raises(OSError):  # io.UnsupportedOperation: what faulthandler met before
        sys.stderr.fileno()
    try:
        stack_dumps.install()
        os.kill(os.getpid(), stack_dumps.DUMP_SIGNAL)  # written to fd 2; this process goes on
    finally:
        faulthandler.unregister(stack_dumps.DUMP_SIGNAL)


def test_sigusr1_dumps_every_thread_of_a_coordinator_which_runs_on(tmp_path):
    log = tmp_path / "coordinator.log"
    proc = _start(COORDINATOR, log)
    try:
        _wait_for(log, "diloco coordinator listening on", proc)
        proc.send_signal(stack_dumps.DUMP_SIGNAL)
        text = _wait_for(log, "wait_for_job", proc)  # the main thread waits for the job there
        assert "Current thread" in text or "Thread 0x" in text, text[-3000:]
        assert text.count("Thread 0x") >= 2, "every thread, not only the main one"
        time.sleep(0.5)
        assert proc.poll() is None, "the dump must not stop the process"
    finally:
        code = _stop(proc)
    assert code == 75, log.read_text()[-3000:]  # SIGTERM before the job finished: restart me


def test_the_torchrun_agent_passes_sigusr1_on_to_its_workers_and_not_to_its_log_pump(tmp_path):
    """The agent's own threads are torchrun's; what an operator wants is its workers' stacks (here
    a coordinator run as the agent's one worker, which listens as a worker would). In JSON logs the
    agent and the worker each have a log pump, which must neither get the signal nor die of it: the
    log stays whole, one record per line, to the end."""
    import json

    log = tmp_path / "agent.log"
    proc = _start(["torchrun", "--nnodes=1", "--nproc-per-node=1", "--max-restarts=0", "--master-port=0",
                   "-m", "diloco", *COORDINATOR, "--log-format", "json"], log)
    try:
        _wait_for(log, "diloco coordinator listening on", proc, timeout_s=120.0)
        children = stack_dumps.child_pids(proc.pid)
        workers = [pid for pid in children if not stack_dumps._is_log_pump(pid)]
        assert len(workers) == 1 and len(children) == 2, f"torchrun's worker and the agent's log pump: {children}"
        proc.send_signal(stack_dumps.DUMP_SIGNAL)
        text = _wait_for(log, "wait_for_job", proc)
        assert f"asked the workers (PIDs [{workers[0]}])" in text, text[-3000:]
        assert proc.poll() is None and stack_dumps.child_pids(proc.pid) == children, "agent, worker and pump run on"
    finally:
        code = _stop(proc)
    lines = log.read_text().splitlines()
    assert all(json.loads(line)["msg"] is not None for line in lines if line.strip()), "a line that is not a record"
    assert code == 0 or any("SIGTERM" in line for line in lines[-5:]), lines[-5:]
