"""The exit-code table: docs/operations.md shows exactly ``exit_codes.TABLE``, and each row is produced.

Where each row's code is produced by a real process:
    0   tests/runtime/test_new_user_cli.py (a finished ``diloco run``), test_exit_codes.py (torchrun "0,0")
    1   test_new_user_cli.py (an error in ``--entry`` code, with its traceback)
    2   test_new_user_cli.py (a run folder in use, a data port taken), test_fail_fast.py (every bad path)
    75  below (``diloco torchrun`` sent SIGTERM), tests/coordinator/test_coordinator_finish.py
        (``diloco coordinator`` sent SIGTERM before the job finished), test_exit_codes.py (a rank's 75)
    130 test_new_user_cli.py (Ctrl-C during start-up), test_stops.py and test_sigterm_stop.py (a
        graceful stop with a checkpoint, and one past its deadline)
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from diloco_helpers import free_port

from diloco.runtime.ops import exit_codes

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def doc_rows() -> list[tuple[int, str, str, str]]:
    """The rows of the table in docs/operations.md's "Exit codes" section."""
    text = DOC.read_text()
    section = text.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            rows.append((int(cells[0]), cells[1], cells[2], cells[3]))
    return rows


def test_the_docs_table_is_the_modules_table():
    assert doc_rows() == [(code, exit_codes.MEANING[code], when, does) for code, when, does in exit_codes.TABLE]
    assert [row[0] for row in exit_codes.TABLE] == sorted(exit_codes.MEANING)  # every code, once


def test_the_table_and_restartable_agree():
    for code, _, does in exit_codes.TABLE:
        assert exit_codes.restartable(code) == does.startswith("restart"), code


@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:40312: Connection reset by peer",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.3]:29500",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version 2.21",
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)",
])
def test_a_peer_lost_inside_the_group_is_restart_me_as_a_plain_runtime_error(message):
    assert exit_codes.for_exception(RuntimeError(message)) == exit_codes.RESTART
    assert exit_codes.for_exception(dist.DistBackendError(message)) == exit_codes.RESTART


def test_other_runtime_errors_stay_errors():
    # a group that cannot form (a /dev/shm too small, a NetworkPolicy, a wrong interface) would restart for ever
    for message in ("NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)", "CUDA out of memory",
                    "mat1 and mat2 shapes cannot be multiplied",
                    "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3",
                    "Gloo connectFullMesh failed with [pair.cc:144] no error", "[Errno 111] Connection refused"):
        assert exit_codes.for_exception(RuntimeError(message)) == exit_codes.OTHER, message


def test_a_signal_before_the_job_finished_is_restart_me_and_ctrl_c_is_interrupted():
    assert exit_codes.for_signal(signal.SIGTERM) == 75 and exit_codes.for_signal(signal.SIGHUP) == 75
    assert exit_codes.for_signal(signal.SIGINT) == 130


SLEEPER = textwrap.dedent("""
    import sys, time
    print("rank ready", flush=True)
    time.sleep(60)
""")


@pytest.mark.timeout(90)
def test_diloco_torchrun_sent_sigterm_exits_75_not_143(tmp_path):
    """A group's pod deleted, evicted or drained: its PID 1 (the agent) gets SIGTERM. 143 is a failure
    to a podFailurePolicy; 75 is "restart me"."""
    script = tmp_path / "rank.py"
    script.write_text(SLEEPER)
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "diloco", "torchrun", "--standalone", "--nproc-per-node", "1",
                                 "--monitor-interval", "0.2", str(script)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "rank ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(40)
    finally:
        if proc.poll() is None:
            import os

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert code == 75, text[-3000:]
    assert re.search(r"diloco torchrun: SIGTERM: stopped every worker; exit 75 \(restart me\)", text), text[-3000:]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_diloco_torchrun_signalled_while_it_waits_for_its_other_nodes_exits_at_once(sig, code):
    """Node 0 of a 2-node group whose node 1 never comes (a multi-pod group, its other pod not
    scheduled) waits in torch's C++ rendezvous store, where a Python signal handler does not run:
    deleted then, it exits 75 at once (was: it sat until the kubelet's SIGKILL, 137, a counted failure)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "torchrun", "--nnodes", "2", "--node-rank", "0",
                             "--master-addr", "127.0.0.1", f"--master-port={port}", "--nproc-per-node", "1",
                             "--no-python", "sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):  # its store is up: it waits for node 1 now
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        time.sleep(1)
        proc.send_signal(sig)
        out = proc.communicate(timeout=20)[0]
    finally:
        if proc.poll() is None:
            import os

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, out[-3000:]
    assert f"diloco torchrun: {sig.name} before its workers started; exit {code}" in out, out[-3000:]


def test_a_wrong_secret_is_a_configuration_error_on_both_sides_of_the_handshake():
    """Before, the side that found the other's proof wrong hung up: the other met a lost connection
    (75, restarted for ever) where this side met a wrong secret (2). Now it says why (REJECT)."""
    import socket
    import threading

    from transport import CollectiveAborted, PeerAuthError
    from transport.auth import client_handshake, server_handshake

    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    server_error: list[BaseException] = []

    def serve() -> None:
        try:
            server_handshake(b, b"the-other-groups-secret")
        except BaseException as e:  # noqa: BLE001 - asserted below
            server_error.append(e)

    th = threading.Thread(target=serve)
    th.start()
    with pytest.raises(PeerAuthError, match="wrong shared secret") as client:
        client_handshake(a, b"this-groups-secret", "me:1", "server")
    th.join(5)
    a.close()
    b.close()
    assert len(server_error) == 1 and isinstance(server_error[0], PeerAuthError), server_error
    assert "wrong shared secret" in str(server_error[0])
    assert exit_codes.for_exception(client.value) == exit_codes.for_exception(server_error[0]) == exit_codes.CONFIGURATION
    from diloco.exchange.quorum_averager import ExchangeFailed

    gave_up = ExchangeFailed("exchange 3 rolled back 20 times in a row (the last: authentication failed)")
    assert exit_codes.for_exception(gave_up) == exit_codes.RESTART  # a corrupting link, a bug: restart
    gave_up.auth_failure = server_error[0]  # every attempt met the wrong secret: so would a restart
    assert exit_codes.for_exception(gave_up) == exit_codes.CONFIGURATION
    try:  # as the exchange meets it: a collective aborted by the failed handshake
        raise CollectiveAborted("authentication failed with a ring neighbour") from server_error[0]
    except CollectiveAborted as aborted:
        assert exit_codes.for_exception(aborted) == exit_codes.CONFIGURATION


SIGTERM_RANK = textwrap.dedent("""
    import logging, os, signal, sys, time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from diloco.runtime.rank import train_loop

    class Keeper:
        every, stop_signalled = int(sys.argv[1]) if sys.argv[1].isdigit() else 0, False
        stopped, stop_timer, last = False, None, None

        def request_stop(self):
            self.stop_signalled = True

    keeper = Keeper() if sys.argv[1] != "none" else None
    train_loop.on_sigterm(keeper, float(sys.argv[2]))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    print("asked to stop:", keeper.stop_signalled if keeper else None, flush=True)
    if sys.argv[3] == "again":
        os.kill(os.getpid(), signal.SIGTERM)  # the second: at once
    time.sleep(8)
    print("still running", flush=True)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("every,grace,second", [("none", "20", "again"), ("0", "20", "again"), ("4", "20", "again"),
                                                ("4", "0", "again"), ("4", "3", "no")])
def test_a_ranks_sigterm_is_never_silent(every, grace, second):
    """Checkpoints on: the first SIGTERM says where the rank will stop; without periodic
    checkpoints (or with --stop-grace 0) it says it stops now, without one, and dies by SIGTERM,
    which ``diloco torchrun`` turns into 75 (``group_exit_code``). A rank that does not reach its
    checkpoint within --stop-grace exits 75 by itself, before the pod's grace period ends in SIGKILL."""
    proc = subprocess.run([sys.executable, "-c", SIGTERM_RANK, every, grace, second], capture_output=True, text=True,
                          timeout=50)
    assert "still running" not in proc.stdout
    if every == "4" and grace == "3":
        assert proc.returncode == exit_codes.RESTART, proc.stderr[-2000:]
        assert "asked to stop: True" in proc.stdout
        assert "SIGTERM: no job checkpoint within --stop-grace 3s: stopping now without one, exit 75" in proc.stderr
        return
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    if every == "none":
        assert "no job checkpoints (no --checkpoint-dir, or rounds by time): stopping now" in proc.stderr
    elif grace == "0":
        assert "--stop-grace 0: stopping now, without a checkpoint" in proc.stderr and "asked to stop" not in proc.stdout
    elif every == "4":
        assert "SIGTERM: checkpointing at the next multiple of --checkpoint-every 4, then stopping, or in 20s" \
            in proc.stderr
        assert "asked to stop: True" in proc.stdout and "SIGTERM: stopping now (a second SIGTERM)" in proc.stderr
    else:
        assert "no periodic checkpoint to stop at (--checkpoint-every 0): stopping now, without a checkpoint" \
            in proc.stderr and "asked to stop" not in proc.stdout
    assert exit_codes.group_exit_code({0: -signal.SIGTERM}) == exit_codes.RESTART


def test_a_rank_that_checkpointed_for_its_own_sigterm_exits_75(monkeypatch, capsys):
    from diloco.job.config import Config
    from diloco.runtime.rank import worker

    summary = {"group": 0, "rank": 0, "inner_steps": 20, "outer_rounds": 2, "bytes_sent": 1, "param_hash": "ab",
               "seconds": 1.0, "utilization": 0.5, "stopped_at_step": 20, "job_checkpoint": "/ck/step-000020",
               "stopped_by": "SIGTERM"}
    monkeypatch.setattr(worker, "run_worker", lambda *a, **k: dict(summary))
    monkeypatch.setattr("diloco.runtime.ops.logs.setup", lambda *a, **k: None)
    assert worker.main(Config(), 0, "127.0.0.1:1") == exit_codes.RESTART
    assert "SIGTERM: stopped at step 20 with checkpoint /ck/step-000020; exit 75 (restart me)" in capsys.readouterr().err
    summary.pop("stopped_by")  # a stop the job agreed on (diloco run's Ctrl-C), or --stop-after
    assert worker.main(Config(), 0, "127.0.0.1:1") == exit_codes.DONE


@pytest.mark.timeout(60)
def test_ctrl_c_to_a_coordinator_before_the_job_finished_is_130():
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "coordinator", "--port", "0", "--groups", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "listening on" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Ctrl-C before the job finished; exit 130 (interrupted)" in err


@pytest.mark.timeout(120)
def _wait_for_sigterm_handler(pid: int, timeout_s: float = 30.0) -> None:
    """Until process ``pid`` catches SIGTERM (its SigCgt mask in /proc): before, the interpreter
    itself is still starting, and no program of its own can handle the signal."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} installed no SIGTERM handler in {timeout_s} s")


def test_a_sigterm_while_the_coordinator_starts_is_restart_me_not_a_dropped_signal():
    """SIGTERM as soon as the process runs (a pod deleted while it starts): a container's PID 1
    without a handler drops it and is SIGKILLed (137, counted); diloco exits 75 at once instead."""
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "coordinator", "--port", "0", "--groups", "2",
                             "--host", "127.0.0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_sigterm_handler(proc.pid)  # diloco's first line ran; the coordinator is still being imported
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == exit_codes.RESTART, (proc.returncode, err[-2000:])
    assert "SIGTERM" in err, err[-2000:]


@pytest.mark.timeout(120)
def test_a_coordinator_port_in_use_is_a_setting_not_a_crash(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags in (["--port", str(port)], ["--port", "0", "--metrics-port", str(port)]):
            proc = subprocess.run([sys.executable, "-m", "diloco", "coordinator", *flags, "--groups", "2",
                                   "--host", "127.0.0.1"], capture_output=True, text=True, timeout=60)
            assert proc.returncode == exit_codes.CONFIGURATION, (flags, proc.stderr[-2000:])
            assert str(port) in proc.stderr, proc.stderr[-2000:]
