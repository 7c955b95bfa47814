"""What a new user meets first, each as typed: an exit code that says what happened, a message
that says what to do, and an end within seconds (slack for a loaded 2-core machine)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diloco import cli
from diloco.runtime.checkpoints import checkpoint_index
from diloco.runtime.launch import graceful_stop, launcher, run_lock
from diloco.runtime.rank import user_errors
from diloco.job.config import Config
from diloco_helpers import free_port_range

TINY = ["--steps", "4", "--h", "2", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
        "--ranks-per-group", "1", "--no-progress"]


def diloco(*args: str, env: dict | None = None, timeout: float = 120.0, cwd: Path | None = None
           ) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started




# --- a, b, d: one finished run with --json in a missing folder, --data-port and --resume auto ------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_fresh_run_makes_its_json_folder_offsets_the_data_port_per_group_and_resume_auto_starts_fresh(tmp_path):
    port = free_port_range(2)
    out = tmp_path / "out" / "run1.json"  # its folder does not exist
    code, output, seconds = diloco("run", *TINY, "--run-dir", str(tmp_path / "run"), "--json", str(out),
                                   "--data-port", str(port), "--resume", "auto")
    assert code == 0, output[-3000:]
    assert out.is_file()
    assert f"--resume auto: no complete checkpoint under {tmp_path / 'run' / 'checkpoints'}; starting fresh" in output
    assert seconds < 120


def test_diloco_run_gives_each_groups_ranks_their_own_data_ports():
    cfg = Config()
    cfg.topology.groups, cfg.topology.group_sizes = 3, "2,1,3"
    cfg.transport.data_port, cfg.transport.advertise_address = 30000, "lb.example:40000"
    assert [launcher.data_port_args(cfg, g) for g in range(3)] == [
        ["--data-port", "30000", "--advertise-address", "lb.example:40000"],
        ["--data-port", "30002", "--advertise-address", "lb.example:40002"],
        ["--data-port", "30003", "--advertise-address", "lb.example:40003"],
    ]
    cfg.transport.data_port = 0
    assert launcher.data_port_args(cfg, 1) == []


@pytest.mark.timeout(60)
def test_a_data_port_in_use_is_refused_before_anything_starts(tmp_path):
    base = free_port_range(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))  # group 1's rank's port
        taken.listen()
        code, output, seconds = diloco("run", *TINY, "--data-port", str(base), "--run-dir", str(tmp_path / "run"))
    assert code == 2, output[-2000:]
    assert f"--data-port (ports {base}-{base + 1}: one per rank of every group): cannot bind 127.0.0.1:{base + 1}: " \
           "already in use" in output, output[-2000:]
    assert seconds < 15 and not (tmp_path / "run").exists(), seconds


def test_resume_auto_resumes_from_the_newest_complete_step_and_says_so(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr(checkpoint_index, "latest_complete_step",
                        lambda root: 40 if Path(root) == run_dir / "checkpoints" else None)
    args = cli.build_parser().parse_args(["run", "--run-dir", str(run_dir), "--resume", "auto"])
    cli._resume_auto(args)
    assert args.resume == str(run_dir / "checkpoints")
    assert f"--resume auto: resuming from {run_dir / 'checkpoints'} (newest complete step: 40)" in capsys.readouterr().err
    bare = cli.build_parser().parse_args(["run", "--resume", "auto"])
    with pytest.raises(ValueError, match="--resume auto needs --run-dir or --checkpoint-dir"):
        cli._resume_auto(bare)


# --- c: an error in the user's --entry code shows the user's traceback --------------------------------------

USER_TASK = textwrap.dedent("""
    def helper():
        return 1 / 0


    def task(ctx):
        return helper()
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_an_error_in_entry_code_shows_the_users_traceback(tmp_path):
    (tmp_path / "mytask.py").write_text(USER_TASK)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           user_errors.TRACEBACK_ENV: ""}  # off: the traceback comes without it
    code, output, seconds = diloco("run", *TINY, "--entry", "mytask:task", "--max-restarts", "0", "--run-dir",
                                   str(tmp_path / "run"), env=env)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "run").glob("group-*.log")))
    assert code == 1, output[-3000:]
    for text in (output, logs):
        assert "Traceback (most recent call last)" in text, text[-3000:]
        assert 'mytask.py", line 3, in helper' in text and "ZeroDivisionError: division by zero" in text
    assert seconds < 120


def test_which_errors_come_with_a_traceback():
    def users_code():
        raise ValueError("the user's bad value")

    try:
        users_code()
    except ValueError as e:
        err = e
    package = __name__.split(".")[0]
    assert user_errors.raised_in(err, package)
    assert user_errors.wants_traceback(err, f"{package}.mod:task", env={})  # a 2, but from the user's code
    assert not user_errors.wants_traceback(err, "diloco.demo:gpt_task", env={})  # diloco's own 2: one line
    assert user_errors.wants_traceback(err, "", env={user_errors.TRACEBACK_ENV: "1"})
    assert user_errors.wants_traceback(ZeroDivisionError("a bug"), "", env={})  # 1: always
    assert user_errors.entry_package("diloco.demo:gpt_task") is None
    assert user_errors.entry_package("acme.models.gpt:task") == "acme"


# --- e: one run per run folder ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_second_run_in_the_same_run_dir_is_refused_naming_the_first(tmp_path):
    run_dir = tmp_path / "run"
    holder = run_lock.hold("--run-dir", run_dir)  # this process plays the first run
    try:
        code, output, seconds = diloco("run", *TINY, "--run-dir", str(run_dir))
    finally:
        holder.close()
    assert code == 2, output[-2000:]
    assert f"--run-dir {run_dir}: in use by another diloco run (pid {os.getpid()}" in output, output[-2000:]
    assert seconds < 15
    assert sorted(p.name for p in run_dir.iterdir()) == [run_lock.LOCK_NAME]  # nothing of the first's touched


@pytest.mark.timeout(60)
def test_another_run_cannot_write_into_a_running_runs_default_checkpoint_folder(tmp_path):
    first = tmp_path / "first"
    holder = run_lock.hold("--checkpoint-dir", first / "checkpoints")  # what the first run holds besides its folder
    try:
        code, output, seconds = diloco("run", *TINY, "--run-dir", str(tmp_path / "second"), "--checkpoint-every", "2",
                                       "--checkpoint-dir", str(first / "checkpoints"))
    finally:
        holder.close()
    assert code == 2, output[-2000:]
    assert f"--checkpoint-dir {first / 'checkpoints'}: in use by another diloco run" in output, output[-2000:]
    assert seconds < 15


def test_the_lock_goes_with_its_holder(tmp_path):
    first = run_lock.hold("--run-dir", tmp_path)
    with pytest.raises(run_lock.RunDirBusy, match=f"pid {os.getpid()}"):
        run_lock.hold("--run-dir", tmp_path)
    first.close()  # as at the holder's exit, however it exits
    run_lock.hold("--run-dir", tmp_path).close()


# --- f: Ctrl-C during start-up stops at once -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ctrl_c_during_start_up_stops_at_once_with_130(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", *TINY[:1], "100000", *TINY[2:], "--run-dir",
                             str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not list(run_dir.glob("group-*.log")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, output[-3000:]
    assert "SIGINT during start-up: nothing was trained yet, so no checkpoint is needed; stopping now" in output
    assert took < 12, (took, output[-3000:])  # the SIGTERM grace (3 s) and reaping, not a step-0 checkpoint
    assert not list((run_dir / "checkpoints").glob("step-*"))


# --- g: a stop past its deadline after a complete checkpoint names it ------------------------------------


def test_a_stop_past_its_deadline_names_the_checkpoint_written_after_the_signal(monkeypatch):
    stop = graceful_stop.GracefulStop(server=None, timeout_s=lambda: 30.0)  # type: ignore[arg-type]
    stop.signal_name, stop.timeout_s, stop.checkpoint_before = "SIGINT", 30.0, 20
    newest = {"step": 30}
    monkeypatch.setattr(graceful_stop.job_checkpoint, "latest_complete_step", lambda root: newest["step"])
    text = graceful_stop.overdue_message(stop, "/ck", Path("/logs"))
    assert "after they wrote a complete checkpoint at step 30" in text and "resume: diloco run --resume /ck" in text
    assert "did not checkpoint" not in text
    newest["step"] = 20  # nothing new since the signal: the older one is named
    text = graceful_stop.overdue_message(stop, "/ck", Path("/logs"))
    assert "did not checkpoint" in text and "older checkpoint (step 20): diloco run --resume /ck" in text
    newest["step"] = None
    assert "no complete checkpoint to resume from" in graceful_stop.overdue_message(stop, "/ck", Path("/logs"))


def test_the_cli_exits_130_for_a_run_stopped_by_a_signal(monkeypatch, tmp_path, capsys):
    summary = {"interrupted": "SIGTERM", "stopped_at_step": 20}
    monkeypatch.setattr(launcher, "run", lambda cfg, **kw: summary)
    monkeypatch.setattr("diloco.runtime.launch.summary.format_summary", lambda s: "the summary")
    args = cli.build_parser().parse_args(["run", *TINY, "--run-dir", str(tmp_path / "r"), "--json",
                                          str(tmp_path / "new" / "s.json")])
    assert cli._cmd_run(args) == 130
    assert "SIGTERM: stopped at step 20 with a checkpoint; exit 130 (interrupted)" in capsys.readouterr().err
    assert (tmp_path / "new" / "s.json").is_file()
    summary.pop("interrupted")
    assert cli._cmd_run(args) == 0  # --stop-after: a planned stop
