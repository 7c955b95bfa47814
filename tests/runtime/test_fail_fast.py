"""Everyday mistakes, as a user types them: each ends at once with exit code 2 and a message that
names the flag, the path or port and the cause, before any process starts; a worker that waits
says for what."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from diloco_helpers import free_port

from diloco.job.config import ConfigError
from diloco.job.config_parse import load_file
from diloco.runtime.launch import preflight
from diloco.runtime.ops.metrics import WorkerMetrics

TINY = ["--steps", "4", "--h", "2", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
        "--ranks-per-group", "1", "--no-progress"]


def diloco(*args: str, env: dict | None = None, timeout: float = 30.0) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


def bad_run_cases(tmp_path: Path, a_file: Path) -> list[tuple[list[str], str]]:
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "three.json").write_text("3")
    (tmp_path / "null.json").write_text("null")
    (tmp_path / "job.yaml").write_text("sync:\n  h: 30\n")
    return [
        (["--checkpoint-dir", str(a_file / "ck")], f"--checkpoint-dir {a_file}/ck: {a_file} is a regular file"),
        (["--save", str(a_file / "model.pt")], f"--save {a_file}/model.pt: {a_file} is a regular file"),
        (["--save", str(tmp_path)], f"--save {tmp_path}: is a folder; give a file name"),
        (["--json", str(a_file / "s.json")], f"--json {a_file}/s.json: {a_file} is a regular file"),
        (["--run-dir", str(a_file / "run")], f"--run-dir {a_file}/run: {a_file} is a regular file"),
        (["--config", str(tmp_path / "list.json")], "the top level must be an object of sections"),
        (["--config", str(tmp_path / "three.json")], "got int"),
        (["--config", str(tmp_path / "null.json")], "got NoneType"),
        (["--config", str(tmp_path / "job.yaml")], "YAML is not read; config files are TOML (.toml) or JSON (.json)"),
        (["--config", str(tmp_path)], f"config file {tmp_path} is a folder"),
        (["--codec-block", "64"], "--codec-block applies to the codecs with scale blocks or chunks"),
        (["--stop-timeout", "0"], "--stop-timeout must be > 0"),
    ]


@pytest.mark.timeout(300)
def test_every_bad_path_and_config_ends_in_seconds_with_code_2_and_nothing_started(tmp_path, a_file):
    # a codec option is checked by building the codec (compress: torch), which a CUDA host under
    # load takes seconds to import (measured 2.3 s alone on an H200 host): that case gets them on top
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    torch_import_s = time.monotonic() - started
    for args, message in bad_run_cases(tmp_path, a_file):
        run_dir = tmp_path / "never-made"
        code, output, seconds = diloco("run", *TINY, "--run-dir", str(run_dir), *args)
        assert code == 2, (args, output[-2000:])
        assert message in output, (args, output[-2000:])
        assert "Traceback" not in output, output
        assert seconds < 5.0 + (torch_import_s if args[0] == "--codec-block" else 0.0), (args, seconds, torch_import_s)
        assert not run_dir.exists(), f"{args}: the run started (its folder was made)"


def test_paths_flags_and_checkpoints_are_refused_before_torch_is_imported(tmp_path, a_file):
    """A wrong path, TLS file or --resume checkpoint (and any flag of a plain fp32 job) is refused
    without importing torch: at once, even on a host where importing torch (CUDA) takes seconds."""
    (tmp_path / "step-000004").mkdir()  # a step folder no group finished
    cases = [(["--resume", str(tmp_path / "none")], "no complete job checkpoint under"),
             (["--resume", str(tmp_path / "step-000004")], "incomplete checkpoint (complete for groups [] of ?"),
             (["--resume", str(a_file)], "no complete job checkpoint under"),
             (["--checkpoint-dir", str(a_file / "ck")], f"{a_file} is a regular file"),
             (["--json", str(a_file / "s.json")], f"{a_file} is a regular file"),
             (["--tls-cert", str(tmp_path / "no.pem"), "--tls-key", str(tmp_path / "no.key")], "TLS file not found"),
             (["--steps", "0"], "--steps"), (["--stop-timeout", "0"], "--stop-timeout must be > 0")]
    probe = ("import sys; from diloco import cli; code = cli.main(['run', *sys.argv[1:]]); "
             "print('torch imported:', 'torch' in sys.modules); sys.exit(code)")
    for args, message in cases:
        proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stdout + proc.stderr)
        assert "torch imported: False" in proc.stdout, (args, proc.stdout)


@pytest.mark.timeout(60)
def test_a_metrics_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # group 1's rank sits on port + 1: the whole range the run will bind is checked
        code, output, seconds = diloco("run", *TINY, "--metrics-port", str(port - 1), "--run-dir",
                                       str(tmp_path / "run"))
    assert code == 2 and f"--metrics-port: cannot bind 127.0.0.1:{port}: already in use" in output, output[-2000:]
    assert seconds < 5.0 and not (tmp_path / "run").exists(), (seconds, output[-2000:])


@pytest.mark.timeout(60)
def test_a_worker_checks_what_it_will_write_before_it_joins(tmp_path, a_file):
    code, output, seconds = diloco("worker", "--coordinator", "127.0.0.1:9", "--group-id", "0", "--save",
                                   str(a_file / "m.pt"), env={"DILOCO_SECRET": "ab" * 32, "RANK": "0"})
    assert code == 2 and f"--save {a_file}/m.pt: {a_file} is a regular file" in output, output[-2000:]
    assert seconds < 5.0, (seconds, output[-2000:])
    probe = ("import sys; from diloco import cli; code = cli.main(['worker', *sys.argv[1:]]); "
             "print('torch imported:', 'torch' in sys.modules); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, "--coordinator", "127.0.0.1:9", "--group-id", "0",
                           "--json", str(a_file / "s.json")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DILOCO_SECRET": "ab" * 32, "RANK": "0"})
    assert proc.returncode == 2 and f"--json {a_file}/s.json: {a_file} is a regular file" in proc.stderr, proc.stderr
    assert "torch imported: False" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_says_what_it_waits_for_and_exits_75_when_the_coordinator_never_answers():
    port, master = free_port(), free_port()  # nothing listens on port
    code, output, seconds = diloco("worker", "--coordinator", f"127.0.0.1:{port}", "--group-id", "0",
                                   "--groups", "1", "--ranks-per-group", "1", "--timeout", "12",
                                   env={"DILOCO_SECRET": "ab" * 32, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}, timeout=90)
    assert f"waiting for the coordinator at 127.0.0.1:{port} to answer (last error:" in output, output[-3000:]
    assert "(10 s so far)" in output
    assert code == 75, output[-3000:]  # a coordinator that is not there: a fault, restart me
    assert 12 <= seconds < 40


def test_preflight_names_the_cause(tmp_path, a_file):
    preflight.check_writable_folder("--checkpoint-dir", tmp_path / "new" / "deeper")  # made later: fine
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".diloco-write-probe-*"))
    preflight.check_writable_file("--json", tmp_path / "out" / "s.json")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        preflight.check_writable_folder("--run-dir", a_file)
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        if os.geteuid() != 0:  # root writes anywhere: the permission case needs another user
            with pytest.raises(ConfigError, match="permission denied"):
                preflight.check_writable_file("--save", readonly / "m.pt")
    finally:
        readonly.chmod(0o700)
    with pytest.raises(ConfigError, match="port 70000 is outside 1-65535"):
        preflight.check_ports("--metrics-port", "127.0.0.1", [70000])


def test_config_files_of_the_wrong_shape_or_format_are_named(tmp_path):
    cases = {"a.json": ("[1]", "top level must be an object"), "b.json": ('{"sync": 3}', "[sync] must be a table"),
             "c.yml": ("a: 1", "YAML is not read"), "d.toml": ("h = [", "as TOML"),
             "e.conf": ("{", "a file not named .json is read as TOML")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
            load_file(tmp_path / name)
    (tmp_path / "ok.json").write_text(json.dumps({"sync": {"h": 7}}))
    assert load_file(tmp_path / "ok.json").sync.h == 7


def test_worker_metrics_listen_on_the_given_host_only():
    metrics = WorkerMetrics(0, 0)
    try:
        metrics.serve(0)
        assert metrics.server.server_address[0] == "127.0.0.1"  # not every interface by default
    finally:
        metrics.close()
