"""``diloco run``'s ``/status`` asks for the job token, which only the user who started the run can
read (``RUN_DIR/coordinator-token``, mode 0600), and ``diloco status --token-file`` sends it.
A group's credential opens nothing there. (A live run: test_credentials_live_run.py.)"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from diloco_helpers import free_port

from diloco import cli
from diloco.coordinator import CoordinatorServer
from diloco.coordinator.credentials import group_token
from diloco.job.config import Config
from diloco.runtime.launch import launcher

TOKEN = "0123456789abcdef0123456789abcdef"


def _status(port: int, token: str | None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/status",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def served(tmp_path):
    """``diloco run``'s coordinator HTTP side, as the launcher starts it (after the ranks' ports)."""
    port = free_port()
    cfg = Config()
    cfg.topology.groups, cfg.topology.ranks_per_group = 2, 1
    cfg.train.metrics_port = port - 2  # the coordinator's is --metrics-port + every rank
    server = CoordinatorServer("127.0.0.1", 0, expected_groups=2, token=TOKEN, join_timeout_s=5.0)
    server.start()
    token_file = tmp_path / launcher.STATUS_TOKEN_FILE
    try:
        http = launcher._serve_coordinator_http(cfg, server, launcher.Placement(), TOKEN, token_file)
    except BaseException:
        server.stop(grace_s=0.2)
        raise
    try:
        yield http.port, token_file
    finally:
        http.close()
        server.stop(grace_s=0.2)


def test_diloco_runs_status_needs_the_job_token_from_a_private_file(served):
    port, token_file = served
    assert token_file.read_text() == TOKEN and token_file.stat().st_mode & 0o777 == 0o600
    assert _status(port, None) == 401
    assert _status(port, group_token(TOKEN, 0)) == 401, "a group's credential must not read the members' addresses"
    assert _status(port, TOKEN) == 200


def test_diloco_status_reads_the_token_file(served, capsys, monkeypatch):
    port, token_file = served
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    assert cli.main(["status", "--address", f"127.0.0.1:{port}"]) == 1
    assert "wrong or missing token" in capsys.readouterr().err
    assert cli.main(["status", "--address", f"127.0.0.1:{port}", "--token-file", str(token_file)]) == 0
    assert "0 of 2 groups joined" in capsys.readouterr().out
    monkeypatch.setenv("DILOCO_TOKEN", group_token(TOKEN, 1))  # the file wins over the environment
    assert cli.main(["status", "--address", f"127.0.0.1:{port}", "--token-file", str(token_file)]) == 0
    capsys.readouterr()
    missing = token_file.with_name("none")
    assert cli.main(["status", "--address", f"127.0.0.1:{port}", "--token-file", str(missing)]) == 1
    assert f"cannot read the token file {missing}" in capsys.readouterr().err


def test_the_token_file_replaces_an_old_one_and_never_writes_through_a_link(tmp_path):
    from diloco.runtime.rank.endpoint import write_secret_file

    target = tmp_path / "elsewhere"
    target.write_text("keep")
    old = tmp_path / "coordinator-token"
    old.write_text("old")
    old.chmod(0o644)
    write_secret_file(old, "new")
    assert old.read_text() == "new" and old.stat().st_mode & 0o777 == 0o600
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        write_secret_file(link, "secret")
    assert target.read_text() == "keep"
