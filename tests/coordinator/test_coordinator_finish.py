"""The coordinator knows when every group has finished; ``diloco coordinator`` then prints the
job's summary and exits (real processes and gRPC on 127.0.0.1, ephemeral ports)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diloco.cli import build_parser
from diloco.coordinator import CoordinatorClient, CoordinatorServer
from diloco.coordinator.messages import QuorumRequest
from diloco.coordinator.rounds import HEAL

ROOT = Path(__file__).resolve().parents[2]
WATCHDOG_S = 30.0  # a coordinator subprocess still alive after this long is killed


def group_summary(group: int, param_hash: str = "sha256:aa") -> dict:
    """A summary with the keys diloco.runtime.rank.worker sends (values made up)."""
    return {"group": group, "eval_loss": 2.5 + 0.25 * group, "initial_eval_loss": 5.5,
            "outer_rounds": 10, "inner_steps": 300, "bytes_sent": 1000, "bytes_received": 900,
            "param_hash": param_hash, "num_parameters": 4096, "tokens": 10_000,
            "seconds": 10.0 + group, "utilization": 0.9, "mode": "blocking", "fragments": 1,
            "round_hashes": [param_hash]}


def join_groups(address: str, groups: int) -> None:
    """Join ``groups`` groups of one rank each, concurrently (a join waits for the quorum)."""
    errors: list[Exception] = []

    def one(g: int) -> None:
        try:
            with CoordinatorClient(address, timeout_s=5.0) as c:
                c.join(g, 0, 1, f"127.0.0.1:{20000 + g}", timeout_s=10.0)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(g,)) for g in range(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


# --- CoordinatorServer.wait_finished ------------------------------------------------------------

def test_wait_finished_returns_summaries_once_every_group_reported():
    with CoordinatorServer("127.0.0.1", 0, expected_groups=2, join_timeout_s=10.0) as srv:
        join_groups(srv.address, 2)
        assert srv.wait_finished(timeout_s=0.05) is None
        with CoordinatorClient(srv.address, timeout_s=5.0) as c:
            c.report_summary(1, group_summary(1))
            start = time.monotonic()
            assert srv.wait_finished(timeout_s=0.2) is None  # one of two is not finished
            assert 0.15 < time.monotonic() - start < 2.0
            timer = threading.Timer(0.2, c.report_summary, args=(0, group_summary(0)))
            timer.start()
            try:
                got = srv.wait_finished()  # no limit
            finally:
                timer.join()
    assert got == {0: group_summary(0), 1: group_summary(1)}


def test_stop_releases_wait_finished():
    srv = CoordinatorServer("127.0.0.1", 0, expected_groups=2)
    srv.start()
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(srv.wait_finished()))
    waiter.start()
    time.sleep(0.2)
    assert not srv.stopped
    srv.stop(grace_s=0.2)
    waiter.join(timeout=5)
    assert not waiter.is_alive() and result == [None] and srv.stopped
    assert srv.wait_finished(timeout_s=10.0) is None  # at once once stopped


def test_wait_finished_rejects_negative_timeout():
    with CoordinatorServer("127.0.0.1", 0, expected_groups=1) as srv:
        with pytest.raises(ValueError, match="timeout_s"):
            srv.wait_finished(timeout_s=-1)


# --- diloco coordinator -------------------------------------------------------------------------

class Coordinator:
    """A ``diloco coordinator --port 0`` subprocess; ``address`` is read from its first line."""

    def __init__(self, *args: str, groups: int = 2, python: tuple[str, ...] = ("-m", "diloco")) -> None:
        env = {k: v for k, v in os.environ.items() if k != "DILOCO_TOKEN"}
        self.proc = subprocess.Popen(
            [sys.executable, *python, "coordinator", "--host", "127.0.0.1", "--port", "0",
             "--groups", str(groups), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self._watchdog = threading.Timer(WATCHDOG_S, self.proc.kill)
        self._watchdog.start()
        try:
            first = self.proc.stdout.readline()
            found = re.fullmatch(r"diloco coordinator listening on (\S+) for \d+ groups\n", first)
            assert found, f"unexpected first line {first!r}"
        except BaseException:
            self.kill()
            raise
        self.address = found.group(1)

    def finish(self, timeout_s: float = 10.0) -> tuple[int, str, str]:
        """Wait for it to exit by itself; returns (exit code, rest of stdout, stderr)."""
        out, err = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        """Kill it if still running (idempotent)."""
        self._watchdog.cancel()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


def report(address: str, summaries: dict[int, dict]) -> None:
    """Report each group's summary in key order; every report must be acknowledged."""
    with CoordinatorClient(address, timeout_s=5.0) as c:
        for g, summary in summaries.items():
            c.report_summary(g, summary)


def test_exits_with_the_job_summary_once_every_group_reported(tmp_path):
    out_json = tmp_path / "job.json"
    coord = Coordinator("--json", str(out_json))
    try:
        join_groups(coord.address, 2)
        report(coord.address, {1: group_summary(1)})
        time.sleep(0.5)
        assert coord.proc.poll() is None  # one group of two has finished: still serving
        report(coord.address, {0: group_summary(0)})  # the last report gets its Ack
        code, out, err = coord.finish()
    finally:
        coord.kill()
    assert code == 0, err
    assert "diloco job summary" in out
    assert "eval loss (global model) : 2.5000 nats/token (initial 5.5000)" in out
    assert "eval loss per group      : 2.5000, 2.7500 (mean 2.6250)" in out
    assert "global params identical  : True (sha256:aa, sha256:aa)" in out
    assert "bytes between groups     : 2.0KB (2,000 B) sent" in out
    assert "wall time                : 11.0 s" in out
    job = json.loads(out_json.read_text())
    assert job["ok"] is True and job["params_identical"] is True and job["groups"] == 2
    assert job["eval_loss"] == 2.5 and job["eval_loss_per_group"] == {"0": 2.5, "1": 2.75}
    assert job["bytes_sent"] == 2000 and job["seconds"] == 11.0


def test_a_whole_job_runs_through_the_coordinator_without_importing_torch():
    """The coordinator (its TLS settings and the transport's errors included) never loads torch:
    a restarted coordinator serves at once, not after the seconds torch takes on a CUDA host."""
    said = ("import sys; from diloco import cli; code = cli.main(sys.argv[1:]); "
            "print('torch imported:', 'torch' in sys.modules, file=sys.stderr); sys.exit(code)")
    coord = Coordinator(python=("-c", said))
    try:
        join_groups(coord.address, 2)
        report(coord.address, {0: group_summary(0), 1: group_summary(1)})
        code, out, err = coord.finish()
    finally:
        coord.kill()
    assert code == 0 and "diloco job summary" in out, err
    assert "torch imported: False" in err, err


def test_diverged_parameters_exit_1_after_printing():
    coord = Coordinator()
    try:
        join_groups(coord.address, 2)
        report(coord.address, {0: group_summary(0, "sha256:aa"), 1: group_summary(1, "sha256:bb")})
        code, out, err = coord.finish()
    finally:
        coord.kill()
    assert code == 1
    assert "global params identical  : False, DIVERGED (sha256:aa, sha256:bb)" in out
    assert ("diloco coordinator: the groups' global parameters diverged: group 0 sha256:aa, "
            "group 1 sha256:bb") in err


LATE = {"group": 0, "rank": 0, "joined_late": True,
        "reason": "group 0: the job's groups finished before this group could heal"}


def test_a_group_restarted_after_the_others_finished_does_not_fail_the_job(tmp_path):
    """Group 0 restarts (a killed pod) and asks to heal after group 1 finished: the coordinator
    tells it so, its summary holds no model, and the job still ends cleanly, on group 1's figures."""
    out_json = tmp_path / "job.json"
    coord = Coordinator("--json", str(out_json))
    try:
        join_groups(coord.address, 2)
        report(coord.address, {1: group_summary(1)})
        with CoordinatorClient(coord.address, timeout_s=5.0) as c:
            assert c.join(0, 0, 1, "127.0.0.1:20100", incarnation="second", timeout_s=10.0).heal
            assert c.quorum(QuorumRequest(0, 0, "second", HEAL, healable=True), timeout_s=10.0).finished
            c.report_summary(0, LATE)
        code, out, err = coord.finish()
    finally:
        coord.kill()
    assert code == 0, err
    assert "eval loss (global model) : 2.7500 nats/token" in out  # group 1's: the global model
    assert "global params identical  : True (sha256:aa)" in out
    assert "joined too late          : group 0" in out and "left out of the figures above" in out
    job = json.loads(out_json.read_text())
    assert job["ok"] is True and job["model_group_ids"] == [1] and list(job["late_groups"]) == ["0"]


def test_a_late_join_the_coordinator_never_told_fails_the_job():
    """A summary that only says it joined too late (a hostile or confused member) clears nothing."""
    coord = Coordinator()
    try:
        join_groups(coord.address, 2)
        report(coord.address, {1: group_summary(1), 0: LATE})
        code, out, err = coord.finish()
    finally:
        coord.kill()
    assert code == 1 and "joined too late          : group 0" in out
    assert "diloco coordinator: group 0 says it joined too late, but the coordinator never told it" in err


def test_keep_running_prints_and_serves_until_sigterm(tmp_path):
    out_json = tmp_path / "job.json"
    coord = Coordinator("--keep-running", "--json", str(out_json))
    try:
        join_groups(coord.address, 2)
        report(coord.address, {0: group_summary(0), 1: group_summary(1)})
        lines = []
        while not lines or not lines[-1].startswith("  wall time"):
            line = coord.proc.stdout.readline()
            assert line, "stdout closed before the summary was printed"
            lines.append(line)
        assert lines[0] == "diloco job summary\n"
        time.sleep(0.5)
        assert coord.proc.poll() is None  # still serving
        with CoordinatorClient(coord.address, timeout_s=5.0) as c:
            c.report_summary(0, group_summary(0))  # and answering
        assert json.loads(out_json.read_text())["ok"] is True
        coord.proc.send_signal(signal.SIGTERM)
        code, _, err = coord.finish()
    finally:
        coord.kill()
    assert code == 0, err


def test_sigterm_before_the_end_stops_it_without_a_summary_and_asks_for_a_restart(tmp_path):
    out_json = tmp_path / "job.json"
    coord = Coordinator("--json", str(out_json))
    try:
        join_groups(coord.address, 2)
        report(coord.address, {0: group_summary(0)})
        coord.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        code, out, err = coord.finish()
        assert time.monotonic() - start < 5.0
    finally:
        coord.kill()
    assert code == 75, err  # restart me: a Job would be Complete (and never replaced) with 0
    assert "SIGTERM before the job finished; exit 75 (restart me)" in err
    assert out == "" and not out_json.exists()


def test_help_names_the_new_flags_with_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["coordinator", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--keep-running" in text and "(default: False)" in text
    assert "--json PATH" in text and "(default: None)" in text
