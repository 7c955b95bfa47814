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
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from diloco.runtime import exit_codes

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
    "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3",
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)",
])
def test_a_peer_lost_inside_the_group_is_restart_me_as_a_plain_runtime_error(message):
    assert exit_codes.for_exception(RuntimeError(message)) == exit_codes.RESTART
    assert exit_codes.for_exception(dist.DistBackendError(message)) == exit_codes.RESTART


def test_other_runtime_errors_stay_errors():
    for message in ("NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)", "CUDA out of memory",
                    "mat1 and mat2 shapes cannot be multiplied"):
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
    try:  # as the exchange meets it: a collective aborted by the failed handshake
        raise CollectiveAborted("authentication failed with a ring neighbour") from server_error[0]
    except CollectiveAborted as aborted:
        assert exit_codes.for_exception(aborted) == exit_codes.CONFIGURATION
