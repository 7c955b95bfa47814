"""``diloco torchrun``'s stores listen on one address, not every interface (diloco/runtime/launch/agent.py).

torch's TCPStore servers (torchrun's rendezvous store, the store its workers share) listen on
every interface and authenticate nobody; ``diloco torchrun`` binds each to the address its
clients dial. A store bound to 127.0.0.1 refuses a connection to 127.0.0.2 (the same loopback
interface): that is how these tests tell a bound store from one on every interface. The live
``diloco run`` check (every listening socket of the run) is in test_credentials_live_run.py.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
from diloco_helpers import free_port

from diloco.runtime.launch import agent


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def test_a_bound_store_listens_only_on_its_host():
    store = agent.bound_tcp_store("127.0.0.1", 0, None, True, timedelta(seconds=10), multi_tenant=True)
    client = agent.bound_tcp_store("127.0.0.1", store.port, None, False, timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert _accepts("127.0.0.1", store.port)
    assert not _accepts("127.0.0.2", store.port), "the store listens beyond 127.0.0.1"
    legacy = agent.bound_tcp_store("127.0.0.1", 0, is_master=True, use_libuv=False)  # the other server backend
    assert _accepts("127.0.0.1", legacy.port) and not _accepts("127.0.0.2", legacy.port)


def test_a_store_is_not_bound_to_an_address_of_another_host():
    import torch.distributed as dist

    with pytest.raises(dist.DistNetworkError, match="must be one of this host's"):
        agent.store_listener("203.0.113.7", 0)  # TEST-NET-3: no interface here holds it


def test_the_interface_of_an_address():
    assert agent.interface_of("127.0.0.1") == agent.interface_of("127.0.0.2") == agent.interface_of("localhost")
    assert agent.interface_of("127.0.0.1") in {name for name, _, loopback in agent.interface_addresses() if loopback}
    assert agent.interface_of("0.0.0.0") is None and agent.interface_of("::") is None  # every interface, as asked
    with pytest.raises(RuntimeError, match="no interface of this host holds --local-addr 203.0.113.7"):
        agent.interface_of("203.0.113.7")


WORKER = textwrap.dedent("""
    import json, os, socket
    import torch.distributed as dist
    dist.init_process_group("gloo")
    port = int(os.environ["MASTER_PORT"])
    def accepts(host):
        try:
            socket.create_connection((host, port), timeout=5).close()
            return True
        except OSError:
            return False
    seen = {"rank": dist.get_rank(), "master": os.environ["MASTER_ADDR"], "loopback": accepts("127.0.0.1"),
            "other": accepts("127.0.0.2"), "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
            "nccl": os.environ.get("NCCL_SOCKET_IFNAME")}
    print("SEEN " + json.dumps(seen), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_diloco_torchrun_binds_its_stores_and_the_workers_gloo_to_the_local_address(tmp_path, rendezvous):
    """The rendezvous the Kubernetes manifests use (static: --master-addr/--master-port, pod 0
    hosts the store) and the one ``diloco run`` uses (c10d at --host, the workers' own store at
    --local-addr): the store the workers were told of answers on 127.0.0.1 and not on 127.0.0.2,
    and Gloo/NCCL use the loopback interface."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    if rendezvous == "static":
        how = ["--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    else:
        how = ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=bind-test",
               "--rdzv-conf=is_host=1"]
    env = {k: v for k, v in __import__("os").environ.items() if k not in agent.IFNAME_ENVS}
    proc = subprocess.run([sys.executable, "-m", "diloco", "torchrun", *how, "--local-addr=127.0.0.1",
                           "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.2", str(script)],
                          capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # the two ranks share the agent's stdout: their lines may run into each other
    seen = [json.loads(found) for found in re.findall(r"SEEN (\{[^{}]*\})", proc.stdout)]
    assert sorted(s["rank"] for s in seen) == [0, 1], proc.stdout
    loopback = agent.interface_of("127.0.0.1")
    for s in seen:
        assert s["master"] == "127.0.0.1" and s["loopback"], s
        assert not s["other"], f"the workers' store listens beyond 127.0.0.1: {s}"
        assert s["gloo"] == s["nccl"] == loopback, s


@pytest.fixture
def in_process_agent(monkeypatch):
    """``agent.main`` run in this process leaves it as it was: no parent PID handed on (the next
    call would exit at once), SIGUSR1's handler and torch's store classes untouched."""
    import signal as signals

    monkeypatch.delenv(agent.PARENT_ENV, raising=False)
    monkeypatch.setattr(agent, "bind_stores", lambda: None)
    monkeypatch.setattr(logging.Handler, "handleError", logging.Handler.handleError)
    before = signals.getsignal(signals.SIGUSR1)
    yield
    signals.signal(signals.SIGUSR1, before)


def _signal_inside_a_prof_wrapper(monkeypatch, sigval):
    """torchrun's handler raises SignalException in the first bytecodes of a ``@metrics.prof``
    method (torch's own wrapper, before its ``start`` is set): what reaches ``diloco torchrun``."""
    import signal as signals

    from torch.distributed.elastic.metrics import api as metrics
    from torch.distributed.elastic.multiprocessing.api import SignalException

    class SignalledClock:
        def time(self):
            raise SignalException(f"Process {12345} got signal: {sigval}", sigval=signals.Signals(sigval))

    @metrics.prof
    def _monitor_workers():
        raise AssertionError("the signal comes first")

    def torchrun_main(argv):
        monkeypatch.setattr(metrics, "time", SignalledClock())
        _monitor_workers()

    return torchrun_main


@pytest.mark.parametrize("sigval, code", [(15, 75), (2, 130)])
def test_a_death_signal_torch_turns_into_an_unbound_local_error_still_exits_by_its_signal(
        monkeypatch, capsys, in_process_agent, sigval, code):
    from torch.distributed import run as torchrun

    monkeypatch.setattr(torchrun, "main", _signal_inside_a_prof_wrapper(monkeypatch, sigval))
    assert agent.main(["--nproc-per-node", "1", "-m", "diloco", "worker"]) == code
    assert "stopped every worker; exit " + str(code) in capsys.readouterr().err


class _StreamThatFails:
    """A log stream whose write raises ``error``."""

    def __init__(self, error: BaseException):
        self.error = error

    def write(self, text):
        raise self.error

    def flush(self):
        pass


class _StreamSignalled:
    """A log stream whose write sends this process SIGTERM: torch's handler runs inside ``emit``."""

    def write(self, text):
        import os
        import signal as signals

        os.kill(os.getpid(), signals.SIGTERM)

    def flush(self):
        pass


def _log_through(stream, message):
    log = logging.getLogger("torch.distributed.elastic.agent.server.api")  # one of torch's agent loggers
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    try:
        log.warning(message)
    finally:
        log.removeHandler(handler)


def test_a_death_signal_inside_a_log_line_still_exits_by_its_signal(monkeypatch, capsys, in_process_agent):
    """Without ``signals_through_logging`` the handler's ``except Exception`` hands the signal to
    ``handleError``, which prints it and returns: the agent ran on to the kubelet's SIGKILL."""
    import signal as signals

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    def torchrun_main(argv):
        signals.signal(signals.SIGTERM, _terminate_process_handler)  # as torch's agent does with its workers
        _log_through(_StreamSignalled(), "monitoring")
        raise AssertionError("the signal comes first")

    before = signals.getsignal(signals.SIGTERM)
    monkeypatch.setattr(torchrun, "main", torchrun_main)
    try:
        assert agent.main(["--nproc-per-node", "1", "-m", "diloco", "worker"]) == 75
    finally:
        signals.signal(signals.SIGTERM, before)
    err = capsys.readouterr().err
    assert "SIGTERM: stopped every worker; exit 75" in err and "Logging error" not in err
    assert not hasattr(logging.Handler.handleError, "lets_through")  # logging as it was once it returned


def test_other_errors_inside_a_log_line_are_still_only_reported(in_process_agent, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    handle_error = logging.Handler.handleError
    restore = agent.signals_through_logging(SignalException)
    wrapper = logging.Handler.handleError
    agent.signals_through_logging(SignalException)  # twice: one wrapper
    assert logging.Handler.handleError is wrapper is not handle_error
    _log_through(_StreamThatFails(OSError("disk full")), "monitoring")
    err = capsys.readouterr().err
    assert "--- Logging error ---" in err and "disk full" in err
    restore()
    assert logging.Handler.handleError is handle_error


def test_an_agent_error_without_a_signal_is_raised_as_it_is(monkeypatch, in_process_agent):
    from torch.distributed import run as torchrun

    def torchrun_main(argv):
        try:
            raise KeyError("no signal here")
        except KeyError:
            raise RuntimeError("the agent failed")

    monkeypatch.setattr(torchrun, "main", torchrun_main)
    with pytest.raises(RuntimeError, match="the agent failed"):
        agent.main(["--nproc-per-node", "1", "-m", "diloco", "worker"])


def test_the_start_up_guard_leaves_a_later_handler_alone_and_hands_the_signals_back():
    """Once torch's agent has its own SIGTERM handler (its workers started), the guard's watcher lets
    that handler have the signal; ``close`` puts back SIGINT's handler and the wakeup fd."""
    import os
    import signal as signals
    import time

    sigterm_before, sigint_before = signals.getsignal(signals.SIGTERM), signals.getsignal(signals.SIGINT)
    wakeup_before = signals.set_wakeup_fd(-1)
    signals.set_wakeup_fd(wakeup_before)
    guard = agent.StopBeforeWorkers()
    try:
        assert signals.getsignal(signals.SIGTERM) == guard.stop == signals.getsignal(signals.SIGINT)
        caught: list[int] = []
        signals.signal(signals.SIGTERM, lambda signum, frame: caught.append(signum))  # as torch's agent does
        os.kill(os.getpid(), signals.SIGTERM)
        deadline = time.monotonic() + 10
        while not caught and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the watcher has read the signal's byte by now: this process is still here
        assert caught == [signals.SIGTERM]
    finally:
        guard.close()
        signals.signal(signals.SIGTERM, sigterm_before)
    assert signals.getsignal(signals.SIGINT) is sigint_before
    assert signals.set_wakeup_fd(wakeup_before) == wakeup_before
    assert not guard._watcher.is_alive()
