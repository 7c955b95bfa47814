"""tls_problem names why TLS to a coordinator fails, from one handshake, against a real TLS coordinator."""

from __future__ import annotations

import subprocess
import sys

import pytest
from diloco_helpers import free_port

from diloco.coordinator import CoordinatorServer
from diloco.runtime.rank.tls_check import tls_problem
from transport.tls import TlsConfig


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    out = {}
    for name in ("a", "b"):  # two unrelated CAs
        folder = tmp_path_factory.mktemp(f"pki-{name}")
        subprocess.run([sys.executable, "-m", "transport.certs", str(folder), "--name", "coordinator", "--name",
                        "rank", "--san", "127.0.0.1"], check=True, capture_output=True, timeout=60)
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def coordinator(pki):
    a = pki["a"]
    with CoordinatorServer("127.0.0.1", 0, 1, token="tok",
                           tls=TlsConfig(str(a / "coordinator.pem"), str(a / "coordinator.key"), str(a / "ca.pem"))) as s:
        yield s.address


def _files(folder, ca_folder=None):
    return {"cert": str(folder / "rank.pem"), "key": str(folder / "rank.key"), "ca": str((ca_folder or folder) / "ca.pem")}


def test_matching_files_have_no_problem(pki, coordinator):
    assert tls_problem(coordinator, **_files(pki["a"])) is None


def test_a_coordinator_certificate_from_another_ca_is_named(pki, coordinator):
    problem = tls_problem(coordinator, **_files(pki["a"], ca_folder=pki["b"]))
    assert problem and "does not trust the certificate of the coordinator" in problem and "CA file" in problem


def test_a_rank_certificate_the_coordinator_refuses_is_named(pki, coordinator):
    # trusts the coordinator (CA a), shows a certificate of CA b
    files = {"cert": str(pki["b"] / "rank.pem"), "key": str(pki["b"] / "rank.key"), "ca": str(pki["a"] / "ca.pem")}
    problem = tls_problem(coordinator, **files)
    assert problem and "refused this side's certificate" in problem, problem


def test_nothing_listening_is_not_a_tls_problem_and_bad_input_is_an_error(pki):
    port = free_port()
    assert tls_problem(f"127.0.0.1:{port}", **_files(pki["a"])) is None
    with pytest.raises(ValueError, match="host:port"):
        tls_problem("nowhere", **_files(pki["a"]))
    with pytest.raises(OSError):
        tls_problem(f"127.0.0.1:{port}", cert="/nonexistent.pem", key="/nonexistent.key", ca=str(pki["a"] / "ca.pem"))


def test_check_coordinator_raises_at_once_and_waits_for_a_coordinator_not_up_yet(pki, coordinator):
    import time

    from diloco.job.config import ConfigError
    from diloco.runtime.rank.tls_check import check_coordinator

    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="coordinator TLS: this side does not trust"):
        check_coordinator(coordinator, timeout_s=60, **_files(pki["a"], ca_folder=pki["b"]))
    assert time.monotonic() - t0 < 10, "a certificate problem is reported at once, not after the deadline"
    check_coordinator(coordinator, timeout_s=60, **_files(pki["a"]))  # returns: the handshake works
    port = free_port()
    t0 = time.monotonic()
    check_coordinator(f"127.0.0.1:{port}", timeout_s=2.0, poll_s=0.2, **_files(pki["a"]))  # nothing there: waits
    assert 1.5 < time.monotonic() - t0 < 6
