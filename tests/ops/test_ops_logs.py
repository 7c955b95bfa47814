"""One logging setup: text by default, JSON for collectors, group and rank on every worker line."""

from __future__ import annotations

import io
import json
import logging
import sys
import warnings

import pytest

from diloco.runtime.ops import logs


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    logs.teardown()


def test_json_records_and_printed_lines_carry_component_group_and_rank():
    out = io.StringIO()
    stdout, stderr = sys.stdout, sys.stderr
    logs.setup("json", component="worker", group=1, rank=3, stream=out)
    logging.getLogger("diloco.test").info("joined epoch %d", 2, extra={"epoch": 2})
    print("diloco worker group 1 rank 3: done")
    print("diloco worker (group 1, rank 3): boom", file=sys.stderr)
    warnings.warn("careful", UserWarning, stacklevel=1)
    try:
        raise ValueError("bad")
    except ValueError:
        logging.getLogger("diloco.test").exception("failed")
    logs.teardown()
    assert sys.stdout is stdout and sys.stderr is stderr
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert all(r["component"] == "worker" and r["group"] == 1 and r["rank"] == 3 for r in records)
    assert records[0]["msg"] == "joined epoch 2" and records[0]["epoch"] == 2 and records[0]["level"] == "INFO"
    assert records[1] == {**records[1], "logger": "diloco.stdout", "level": "INFO",
                          "msg": "diloco worker group 1 rank 3: done"}
    assert records[2]["logger"] == "diloco.stderr" and records[2]["level"] == "ERROR"
    assert records[3]["level"] == "WARNING" and "careful" in records[3]["msg"]
    assert records[4]["msg"] == "failed" and "ValueError: bad" in records[4]["exc"]
    assert records[0]["ts"].endswith("Z") and len(records) == 5


def test_text_lines_name_the_group_and_rank_and_leave_prints_alone(capsys):
    out = io.StringIO()
    logs.setup("text", component="worker", group=0, rank=1, stream=out)
    logging.getLogger("transport.core").warning("lost %s", "peer")
    print("plain")
    line = out.getvalue().strip()
    assert line.endswith("WARNING transport.core [worker group 0 rank 1] lost peer"), line
    assert capsys.readouterr().out == "plain\n"


def test_a_process_without_group_shows_only_its_component():
    out = io.StringIO()
    logs.setup("json", component="coordinator", stream=out)
    logging.getLogger("diloco.coordinator").info("up")
    record = json.loads(out.getvalue())
    assert record["component"] == "coordinator" and "group" not in record and "rank" not in record


def test_setup_replaces_itself_and_rejects_unknown_formats():
    first, second = io.StringIO(), io.StringIO()
    logs.setup("text", component="run", stream=first)
    logs.setup("text", component="run", stream=second)
    logging.getLogger("x").info("once")
    assert first.getvalue() == "" and second.getvalue().count("once") == 1
    with pytest.raises(ValueError, match="log format must be one of text, json"):
        logs.setup("xml", component="run")


def test_json_wraps_every_line_of_the_process_native_writes_and_children_included():
    """What reaches the file descriptors (a C++ warning, a child process's raw lines) becomes a
    record; lines that are records already (a child's own JSON) pass through unchanged."""
    import subprocess

    code = "\n".join([
        "import logging, os, subprocess, sys",
        "from diloco.runtime.ops import logs",
        "logs.setup('json', component='worker', group=0, rank=0)",
        "os.write(2, b'[W socket.cpp:207] [c10d] a native warning\\n')",
        "os.write(1, b'{\"ts\": \"t\", \"level\": \"INFO\", \"msg\": \"a record of a child\"}\\n')",
        "print('printed')",
        "subprocess.run([sys.executable, '-c', 'import sys; print(\"child out\"); print(\"child err\", file=sys.stderr)'])",
        "logging.getLogger('t').info('logged')",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (result.stdout + result.stderr).splitlines()]
    msgs = {r["msg"]: r for r in records}
    assert set(msgs) == {"[W socket.cpp:207] [c10d] a native warning", "a record of a child", "printed",
                         "child out", "child err", "logged"}
    assert msgs["a record of a child"] == {"ts": "t", "level": "INFO", "msg": "a record of a child"}
    assert msgs["child err"]["level"] == "ERROR" and msgs["child out"]["level"] == "INFO"
    assert all(r["component"] == "worker" for m, r in msgs.items() if m != "a record of a child")


def test_the_coordinators_job_summary_is_json_too():
    """The summary is printed after the command's JSON setup: every line of it is a record."""
    from diloco.coordinator.finish import report_job

    out = io.StringIO()
    logs.setup("json", component="coordinator", stream=out)
    summary = {"group": 0, "rank": 0, "eval_loss": 3.0, "initial_eval_loss": 5.0, "inner_steps": 10,
               "outer_rounds": 1, "param_hash": "ab", "bytes_sent": 10, "bytes_received": 10, "seconds": 1.0,
               "utilization": 0.5, "tokens": 100}
    try:
        report_job({0: summary, 1: {**summary, "group": 1}}, None, joined_late=())
    except (KeyError, TypeError) as e:  # the summary's required fields changed: keep this test's in step
        pytest.fail(f"a summary of this shape no longer formats: {e!r}")
    lines = out.getvalue().splitlines()
    records = [json.loads(line) for line in lines]
    assert any(r["msg"].startswith("diloco job summary") for r in records), lines
    assert all(r["component"] == "coordinator" for r in records)


def test_native_output_written_under_the_interpreter_lock_does_not_block_the_process():
    """Native code that writes megabytes to stderr while holding the interpreter lock (as torch's
    C++ warnings may) must not deadlock: the pipe is drained by a process of its own."""
    import subprocess

    code = "\n".join([
        "import ctypes",
        "from diloco.runtime.ops import logs",
        "logs.setup('json', component='worker', group=0, rank=0)",
        "line = b'[W native] ' + b'x' * 500 + b'\\n'",
        "data = line * 4000",  # 2 MB, far above a pipe's 64 KiB
        "ctypes.PyDLL(None).write(2, data, len(data))",  # PyDLL: the lock stays held during the call
        "print('done')",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (result.stdout + result.stderr).splitlines()]
    assert sum(r["msg"].startswith("[W native]") for r in records) == 4000
    assert any(r["msg"] == "done" for r in records)
