"""Exit codes say why a process stopped, survive torchrun (``diloco torchrun``), and decide restarts."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from diloco.coordinator import CoordinatorError
from diloco.engine.initial import InitialParamsMismatch
from diloco.exchange.heartbeat import GroupEvicted
from diloco.exchange.quorum_averager import ExchangeFailed
from diloco.job.config import ConfigError
from diloco.runtime.checkpoints.checkpoint import CheckpointError
from diloco.runtime.launch.supervise import GroupFailed, Supervisor
from diloco.runtime.ops import exit_codes
from transport import CollectiveAborted
from transport.errors import PeerAuthError

RESTART, CONFIG, OTHER = exit_codes.RESTART, exit_codes.CONFIGURATION, exit_codes.OTHER


@pytest.mark.parametrize("exc, code", [
    (GroupEvicted("out"), RESTART), (ExchangeFailed("again and again"), RESTART),
    (CoordinatorError("gone", "UNAVAILABLE"), RESTART), (CoordinatorError("slow", "DEADLINE_EXCEEDED"), RESTART),
    (CoordinatorError("who are you", "UNAUTHENTICATED"), CONFIG),
    (CoordinatorError("no", "PERMISSION_DENIED"), CONFIG),
    (CollectiveAborted("peer died"), RESTART), (ConnectionResetError("reset"), RESTART),
    (dist.DistNetworkError("gloo: connection closed by peer"), RESTART),
    (PeerAuthError("wrong secret"), CONFIG), (ConfigError("--h must be >= 1"), CONFIG),
    (CheckpointError("corrupt"), CONFIG), (InitialParamsMismatch("different weights"), CONFIG),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory"), CONFIG),
    (PermissionError(errno.EACCES, "Permission denied"), CONFIG),
    (ZeroDivisionError("a bug"), OTHER), (RuntimeError("something else"), OTHER),
    (KeyboardInterrupt(), exit_codes.INTERRUPTED),
])
def test_an_error_maps_to_the_code_of_what_a_restart_can_do(exc, code):
    assert exit_codes.for_exception(exc) == code


@pytest.mark.parametrize("ranks, code", [
    ({0: 0, 1: 0}, 0),
    ({1: 2, 0: -signal.SIGTERM}, CONFIG),  # rank 1's configuration error; torchrun stopped rank 0
    ({0: 75, 1: -signal.SIGTERM}, RESTART),
    ({0: -signal.SIGKILL, 1: 1}, RESTART),  # a rank was killed; its peer then failed on the lost link
    ({0: 1, 1: -signal.SIGTERM}, OTHER),  # an error on rank 0 and the stop that followed: no restart
    ({0: -signal.SIGTERM, 1: -signal.SIGTERM}, RESTART),  # stopped from outside
    ({0: 2, 1: 75}, CONFIG),
    ({0: 75, 1: 1}, OTHER),  # rank 1's bug; rank 0 then lost its peer: counted, not restarted for ever
])
def test_a_groups_code_is_made_of_its_ranks_codes(ranks, code):
    assert exit_codes.group_exit_code(ranks) == code


def test_restartable_codes_are_faults_only():
    assert [c for c in (0, 1, 2, 75, 130, 137, 143, -9, -15) if exit_codes.restartable(c)] == [75, 137, 143, -9, -15]
    assert exit_codes.describe(-9) == "-9 (killed by SIGKILL)" and exit_codes.describe(2) == "2 (configuration error)"


class _Exited:
    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


class _Group:
    def __init__(self, group: int, code: int | None) -> None:
        self.group, self.proc, self.log_path = group, _Exited(code), Path(f"group-{group}.log")

    def tail(self, lines: int = 20) -> str:
        return "diloco worker (group 1, rank 0): the last words"


@pytest.mark.parametrize("code, restarted", [(75, True), (-9, True), (137, True), (2, False), (1, False)])
def test_the_supervisor_restarts_a_group_only_for_a_fault(code, restarted):
    started: list[tuple[int, int]] = []

    def spawn(g: int, attempt: int) -> _Group:
        started.append((g, attempt))
        return _Group(g, code if (g, attempt) == (1, 0) else None)

    told: list[tuple[int, str, int]] = []  # the coordinator is told before the group starts again
    sup = Supervisor(spawn, groups=2, max_restarts=3, on_exit=lambda g, why: told.append((g, why, len(started))))
    sup.start()
    if restarted:
        assert sup.poll(live={0, 1}, progress=0.5) is False
        assert started[-1] == (1, 1) and sup.failures[0]["code"] == code
        assert told == [(1, f"its process exited with code {exit_codes.describe(code)}", 2)]
    else:
        with pytest.raises(GroupFailed, match="which a restart would repeat") as info:
            sup.poll(live={0, 1}, progress=0.5)
        assert info.value.code == code and "the last words" in str(info.value)
        assert started == [(0, 0), (1, 0)] and told == []  # the job ends: nobody waits for group 1


def test_a_group_that_finished_is_not_reported_and_a_drill_s_kill_is_reported_at_once():
    from diloco.runtime.launch.chaos import ChaosPlan

    class KillGroupOnce:  # the drill's decision, without its random timing
        down: set[int] = set()

        def tick(self, now, *, live, running, progress):
            self.down = {1}
            return ChaosPlan(kill=[1] if 1 in running else [])

        def replaced(self, group):  # no spares here: never called
            raise AssertionError("no spare took a group's place")

    procs = {0: subprocess.Popen([sys.executable, "-c", "pass"]),  # finishes: exit 0
             1: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])}
    procs[0].wait()
    told: list[tuple[int, str]] = []
    sup = Supervisor(lambda g, a: _Group(g, None), groups=2, max_restarts=3, chaos=KillGroupOnce(),
                     on_exit=lambda g, why: told.append((g, why)))
    try:
        sup.start()
        for g, proc in procs.items():
            sup.procs[g].proc = proc
        sup.poll(live={0, 1}, progress=0.5)
        assert procs[1].poll() == -signal.SIGKILL and sup.finished == {0}
        assert told == [(1, "its process was killed (SIGKILL, the fault drill)")]
        sup.poll(live={0}, progress=0.5)  # the killed group is down, not exited again
        assert len(told) == 1
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


RANK_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    how = sys.argv[1].split(",")[rank]
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "wait":
        time.sleep(60)
    sys.exit(int(how))
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks, code", [("0,2", 2), ("wait,75", 75), ("kill,wait", 75), ("1,wait", 1), ("0,0", 0)])
def test_diloco_torchrun_keeps_the_workers_code(tmp_path, ranks, code):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "diloco", "torchrun", "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "0.2", str(script), ranks],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert time.monotonic() - started < 40  # the waiting rank was stopped, not waited for
    if code:
        assert f"exit {exit_codes.describe(code)}" in proc.stderr
