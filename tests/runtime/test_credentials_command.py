"""``diloco credentials``: each group's own credentials, for an operator's per-group Secrets.

From the job token and data-plane secret it writes group G's data-plane keyring and coordinator
credential (what ``diloco run`` gives its group G: ``endpoint.group_credentials``), readable by
the owner only; neither file lets group G act for another group or stop the job."""

from __future__ import annotations

import threading

import pytest

from diloco import cli
from diloco.coordinator import CoordinatorClient, CoordinatorError, CoordinatorServer
from diloco.coordinator import credentials
from diloco.runtime.ops import exit_codes
from diloco.runtime.rank.endpoint import CREDENTIAL_FILES, SECRET_ENV, TOKEN_ENV, group_credentials
from transport.identity import GroupKeys, pair_key

TOKEN = "job-token-of-the-operator-0123456789"
SECRET = bytes(range(32))


@pytest.fixture
def job_env(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv(SECRET_ENV, SECRET.hex())


def _files(folder) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def test_each_group_gets_its_own_keys_and_credential_and_nothing_of_the_job(tmp_path, job_env, capsys):
    out = tmp_path / "creds"
    assert cli.main(["credentials", "--groups", "3", "--out", str(out)]) == 0
    assert "kubectl -n diloco create secret generic diloco-credentials-G" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["group-0", "group-1", "group-2"]
    for g in range(3):
        folder = out / f"group-{g}"
        assert folder.stat().st_mode & 0o777 == 0o700
        files = _files(folder)
        assert set(files) == set(CREDENTIAL_FILES.values())
        assert all((folder / name).stat().st_mode & 0o777 == 0o600 for name in files)
        assert files == {CREDENTIAL_FILES[var]: value for var, value in group_credentials(TOKEN, SECRET, g, 3).items()}
        credential = files[CREDENTIAL_FILES[TOKEN_ENV]]
        assert credentials.check(TOKEN, credential) == credentials.Caller(admin=False, group=g, verified=True)
        keys = GroupKeys.from_text(files[CREDENTIAL_FILES[SECRET_ENV]])
        assert keys.group == g and keys.peers == [0, 1, 2]
        assert all(keys.key_for(h) == pair_key(SECRET, g, h) for h in range(3))
        text = "".join(files.values())
        assert TOKEN not in text and SECRET.hex() not in text and not text.endswith("\n")


def test_a_minted_credential_acts_only_for_its_group(tmp_path, job_env):
    out = tmp_path / "creds"
    assert cli.main(["credentials", "--groups", "2", "--out", str(out)]) == 0
    mine = [(out / f"group-{g}" / CREDENTIAL_FILES[TOKEN_ENV]).read_text() for g in (0, 1)]
    with CoordinatorServer("127.0.0.1", 0, expected_groups=2, token=TOKEN, join_timeout_s=10.0) as srv:
        joined = {}

        def join(g: int) -> None:
            with CoordinatorClient(srv.address, token=mine[g], timeout_s=10.0) as c:
                joined[g] = c.join(g, 0, 1, f"127.0.0.1:{21900 + g}", incarnation="first")

        threads = [threading.Thread(target=join, args=(g,)) for g in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert joined[0].groups == [0, 1]
        with CoordinatorClient(srv.address, token=mine[1], timeout_s=10.0) as evil:
            with pytest.raises(CoordinatorError) as rejoin:  # group 0 under a new incarnation
                evil.join(0, 0, 1, "127.0.0.1:9", incarnation="attacker", timeout_s=5.0)
            assert rejoin.value.code == "PERMISSION_DENIED"
            with pytest.raises(CoordinatorError) as stop:
                evil.request_stop("attacker")
            assert stop.value.code == "PERMISSION_DENIED"
        snap = srv.snapshot()
        assert snap["groups"][0]["ranks"] == {0: "127.0.0.1:21900"} and snap["rounds_state"]["stop"] is None


@pytest.mark.parametrize("env, args, message", [
    ({SECRET_ENV: SECRET.hex()}, [], "set DILOCO_TOKEN to the job token"),
    ({TOKEN_ENV: TOKEN}, [], "set DILOCO_SECRET to the job's data-plane secret"),
    ({TOKEN_ENV: TOKEN, SECRET_ENV: "abcd"}, [], "at least 16 bytes"),
    ({TOKEN_ENV: credentials.group_token(TOKEN, 0), SECRET_ENV: SECRET.hex()}, [], "not a group's credential"),
    ({TOKEN_ENV: TOKEN, SECRET_ENV: GroupKeys.derive(SECRET, 0, peers=[0, 1]).to_text()}, [],
     "holds one group's keyring"),
    ({TOKEN_ENV: TOKEN, SECRET_ENV: SECRET.hex()}, ["--groups", "0"], "--groups must be >= 1"),
])
def test_refusals(tmp_path, monkeypatch, capsys, env, args, message):
    for var in (TOKEN_ENV, SECRET_ENV):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    argv = ["credentials", "--groups", "2", "--out", str(tmp_path / "creds"), *args]
    assert cli.main(argv) == exit_codes.CONFIGURATION
    assert message in capsys.readouterr().err
    assert not (tmp_path / "creds").exists()


def test_existing_credentials_are_not_overwritten(tmp_path, job_env, capsys):
    out = tmp_path / "creds"
    assert cli.main(["credentials", "--groups", "2", "--out", str(out)]) == 0
    before = _files(out / "group-1")
    capsys.readouterr()
    assert cli.main(["credentials", "--groups", "2", "--out", str(out)]) == exit_codes.CONFIGURATION
    assert "not overwriting existing credentials" in capsys.readouterr().err
    assert _files(out / "group-1") == before
