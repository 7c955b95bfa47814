"""`ProcessTransport`: the transport in a child process gives the in-process transport's results
and errors, and its process never outlives its trainer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import compress
from transport import CollectiveAborted, GroupKeys, ProcessTransport, TcpTransport, TransportError
from transport.control import ControlClosed, recv_message, send_message
from cuda_helpers import sleep_on_cuda_stream
from transport_helpers import SECRET, transports


def _ring(members, xs, tag, **kw):
    ring = [m.address for m in members]
    handles = [m.all_reduce(x, ring, i, tag=tag, **kw) for i, (m, x) in enumerate(zip(members, xs))]
    return [h.wait() for h in handles]


@pytest.fixture(scope="module")
def plane():
    """One data-plane process for the tests that need a member (starting one imports torch: ~1 s)."""
    p = ProcessTransport(secret=SECRET, timeout_s=10.0, chunk_bytes=64 << 10)
    yield p
    p.close()


@pytest.mark.parametrize("codec", [None, "int8", "int4"])
def test_a_ring_with_a_data_plane_process_gives_the_in_process_rings_bits(plane, codec) -> None:
    n = 300_001
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    c = compress.get_codec(codec) if codec else None
    with transports(g=3, chunk_bytes=64 << 10) as ts:
        reference = _ring(ts, xs, tag=f"ref-{codec}", codec=c)
        mixed = _ring([plane, ts[1], ts[2]], xs, tag=f"mixed-{codec}", codec=c)
    for r, m in zip(reference, mixed):
        assert torch.equal(r, m)
    out = torch.empty(n)
    with transports(g=1, chunk_bytes=64 << 10) as (t,):
        h0 = plane.all_reduce(xs[0], [plane.address, t.address], 0, tag=f"out-{codec}", codec=c, out=out)
        h1 = t.all_reduce(xs[1], [plane.address, t.address], 1, tag=f"out-{codec}", codec=c)
        assert h0.wait() is out and torch.equal(out, h1.wait())


def test_all_gather_mean_reports_what_the_others_decoded_of_ours(plane) -> None:
    n = 50_000
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    codec = compress.get_codec("sign1")
    with transports(g=2, chunk_bytes=64 << 10) as ts:
        ring = [t.address for t in ts]
        ref = [t.all_gather_mean(x, ring, i, tag="ag-ref", codec=codec, scales=[1.0, 0.5])
               for i, (t, x) in enumerate(zip(ts, xs))]
        ref_means = [h.wait() for h in ref]
        ring = [plane.address, ts[1].address]
        sent = torch.empty(n)
        hs = [plane.all_gather_mean(xs[0], ring, 0, tag="ag", codec=codec, sent=sent, scales=[1.0, 0.5]),
              ts[1].all_gather_mean(xs[1], ring, 1, tag="ag", codec=codec, scales=[1.0, 0.5])]
        means = [h.wait() for h in hs]
    assert torch.equal(means[0], ref_means[0]) and torch.equal(means[1], ref_means[1])
    assert hs[0].sent is sent and torch.equal(sent, ref[0].sent)


def test_a_refused_collective_raises_at_the_call_and_a_failed_one_at_wait(plane) -> None:
    x = torch.ones(1000)
    with pytest.raises(ValueError, match="index"):
        plane.all_reduce(x, [plane.address, "127.0.0.1:1"], 5, tag="bad-index")
    with pytest.raises(ValueError, match="float32"):
        plane.all_reduce(x.double(), [plane.address, "127.0.0.1:1"], 0, tag="bad-dtype")
    with TcpTransport("127.0.0.1", 0, secret=SECRET, timeout_s=10.0) as silent:  # never joins
        h = plane.all_reduce(x, [plane.address, silent.address], 0, tag="lonely", timeout_s=0.5)
        with pytest.raises(ValueError, match="already running"):
            plane.all_reduce(x, [plane.address, silent.address], 0, tag="lonely")
        with pytest.raises(CollectiveAborted, match="lonely"):
            h.wait()
        h = plane.all_reduce(x, [plane.address, silent.address], 0, tag="waited", timeout_s=30.0)
        start = time.monotonic()
        with pytest.raises(CollectiveAborted, match="timed out"):
            h.wait(0.3)
        assert time.monotonic() - start < 5.0
        # an abort from outside (the coordinator said a member is gone) ends a running collective
        # now, with the reason given; on one that already ended it does nothing
        for t in (plane, silent):
            h = t.all_reduce(x, [plane.address, silent.address], 0 if t is plane else 1, tag=f"told-{t.address}",
                             timeout_s=30.0)
            threading.Timer(0.2, h.abort, args=("group 1 of quorum q-1 failed",)).start()
            start = time.monotonic()
            with pytest.raises(CollectiveAborted, match="group 1 of quorum q-1 failed"):
                h.wait()
            assert time.monotonic() - start < 5.0
            h.abort("again")
    assert torch.equal(x, torch.ones(1000))  # the input is never written
    counters = plane.counters()
    assert plane.bytes_sent == counters["bytes_sent"] > 0


def test_group_credentials_reach_the_data_plane() -> None:
    """A keyring holding only group 0's pair keys: the ring with group 1 works, and the child
    proves group 0 (a peer expecting another group for that address refuses its data)."""
    job = b"job-secret-for-groups"
    keys0 = GroupKeys.derive(job, 0, peers=[1])
    with ProcessTransport(secret=keys0, timeout_s=5.0) as p0, \
            TcpTransport("127.0.0.1", 0, secret=GroupKeys.derive(job, 1), timeout_s=5.0) as t1:
        assert p0.group == 0
        ring, x = [p0.address, t1.address], torch.arange(10.0)
        hs = [p0.all_reduce(x, ring, 0, tag="g", groups=[0, 1]), t1.all_reduce(x * 3, ring, 1, tag="g", groups=[0, 1])]
        assert torch.equal(hs[0].wait(), x * 2) and torch.equal(hs[1].wait(), x * 2)
        hs = [p0.all_reduce(x, ring, 0, tag="h", groups=[0, 1], timeout_s=1.0),
              t1.all_reduce(x, ring, 1, tag="h", groups=[2, 1], timeout_s=1.0)]
        for h in hs:
            with pytest.raises(CollectiveAborted):
                h.wait()


def test_a_bad_setting_fails_in_the_constructor_and_leaves_no_process() -> None:
    before = _children()
    with pytest.raises(ValueError, match="chunk_bytes"):
        ProcessTransport(secret=SECRET, chunk_bytes=1)
    with pytest.raises(ValueError, match="plain-text"):
        ProcessTransport(host="192.0.2.1", secret=SECRET)  # refused before it would listen there
    deadline = time.monotonic() + 5
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _children() - before


def test_a_data_plane_that_dies_fails_pending_and_later_calls_clearly() -> None:
    p = ProcessTransport(secret=SECRET, timeout_s=30.0)
    try:
        with TcpTransport("127.0.0.1", 0, secret=SECRET, timeout_s=30.0) as silent:
            h = p.all_reduce(torch.ones(100), [p.address, silent.address], 0, tag="doomed")
            os.kill(p._proc.pid, signal.SIGKILL)
            with pytest.raises(TransportError, match="data-plane process exited"):
                h.wait(10.0)
            with pytest.raises(TransportError, match="data-plane process exited"):
                p.all_reduce(torch.ones(100), [p.address, silent.address], 0, tag="after")
            with pytest.raises(TransportError, match="data-plane process exited"):
                p.counters()
    finally:
        p.close()
    assert p._proc.poll() is not None


def test_close_stops_the_process_and_fails_what_was_running() -> None:
    p = ProcessTransport(secret=SECRET, timeout_s=30.0)
    with TcpTransport("127.0.0.1", 0, secret=SECRET, timeout_s=30.0) as silent:
        h = p.all_reduce(torch.ones(100), [p.address, silent.address], 0, tag="cut")
        p.close(flush_timeout_s=1.0)
        with pytest.raises(TransportError):
            h.wait(10.0)
    assert p._proc.wait(5) == 0
    with pytest.raises(TransportError, match="closed"):
        p.all_reduce(torch.ones(100), [p.address, silent.address], 0, tag="late")


def test_the_data_plane_exits_with_its_trainer_and_ignores_the_group_signals() -> None:
    """SIGTERM/SIGINT to the process group are the trainer's to handle; when the trainer dies
    (SIGKILL: no cleanup at all), its data plane sees the control channel close and exits."""
    code = ("import sys, time; from transport import ProcessTransport; "
            "p = ProcessTransport(secret=b'k' * 16); print(p._proc.pid, flush=True); time.sleep(60)")
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(trainer.stdout.readline())
        os.kill(child, signal.SIGTERM)
        os.kill(child, signal.SIGINT)
        time.sleep(0.5)
        assert _alive(child), "the data plane died of a signal meant for its trainer"
        trainer.kill()
        trainer.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the data plane outlived its trainer"
    finally:
        trainer.kill()
        trainer.wait(10)


def test_the_control_channel_refuses_malformed_messages() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        r, w = os.pipe()
        try:
            send_message(a, {"op": "segment"}, [r])
            msg, fds = recv_message(b)
            assert msg == {"op": "segment"} and len(fds) == 1
            os.write(w, b"x")
            assert os.read(fds[0], 1) == b"x"  # the descriptor arrived and works
            os.close(fds[0])
        finally:
            os.close(r)
            os.close(w)
        a.sendall((1 << 30).to_bytes(4, "big"))
        with pytest.raises(ValueError, match="exceeds"):
            recv_message(b)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.sendall((2).to_bytes(4, "big") + b"[]")
        with pytest.raises(ValueError, match="JSON object"):
            recv_message(b)
        a.sendall((10).to_bytes(4, "big") + b"{")
        a.close()
        with pytest.raises(ControlClosed):
            recv_message(b)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(")")[-1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                found.add(int(entry))
    return found


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", [None, "int8"])
def test_cuda_vectors_cross_to_the_data_plane_and_the_mean_comes_back_to_their_device(plane, codec) -> None:
    """The data plane works on host memory: a CUDA vector is copied in, the mean copied back to
    its device (into out, when given), and equals the CPU ring's bits."""
    n = 100_003
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(20 + i)) for i in range(2)]
    c = compress.get_codec(codec) if codec else None
    with transports(g=2, chunk_bytes=64 << 10) as ts:
        reference = _ring(ts, xs, tag=f"cpu-{codec}", codec=c)
        ring = [plane.address, ts[1].address]
        out = torch.empty(n, device="cuda")
        hs = [plane.all_reduce(xs[0].cuda(), ring, 0, tag=f"cuda-{codec}", codec=c, out=out),
              ts[1].all_reduce(xs[1], ring, 1, tag=f"cuda-{codec}", codec=c)]
        got = hs[0].wait()
        hs[1].wait()
        fresh = plane.all_reduce(xs[0].cuda(), ring, 0, tag=f"fresh-{codec}", codec=c)
        ts[1].all_reduce(xs[1], ring, 1, tag=f"fresh-{codec}", codec=c).wait()
        assert fresh.wait().device.type == "cuda"
    assert got is out and torch.equal(out.cpu(), reference[0])


def test_unusable_buffers_are_refused_before_anything_reaches_the_data_plane(plane) -> None:
    x, ring = torch.ones(100), [plane.address, "127.0.0.1:1"]
    before = plane.counters()["bytes_sent"]
    for bad, match in ((torch.ones(10, 10), "1-D"), (x.double(), "float32")):
        with pytest.raises(ValueError, match=match):
            plane.all_reduce(bad, ring, 0, tag="bad")
    with pytest.raises(ValueError, match="out must not overlap x"):
        plane.all_reduce(x, ring, 0, tag="bad", out=x)
    both = torch.empty(200)
    with pytest.raises(ValueError, match="sent must not overlap out"):
        plane.all_gather_mean(x, ring, 0, tag="bad", codec=compress.get_codec("sign1"), out=both[:100],
                              sent=both[50:150])
    assert plane.counters()["bytes_sent"] == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_mean_is_copied_back_beside_the_callers_stream_not_behind_it(plane) -> None:
    """The copy of the mean to the device goes on a side stream: work queued on the caller's
    stream after the start (the next inner steps) does not hold up wait()."""
    n = 1 << 16
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(30 + i)) for i in range(2)]
    with transports(g=1, chunk_bytes=64 << 10) as (other,):  # the plane's chunk
        ring = [plane.address, other.address]
        reference = _ring([plane, other], xs, tag="cpu")
        h = plane.all_reduce(xs[0].cuda(), ring, 0, tag="beside")
        sleep_on_cuda_stream(3.0)
        other.all_reduce(xs[1], ring, 1, tag="beside").wait()
        got = h.wait(timeout_s=60)
        assert not torch.cuda.current_stream().query(), "the copy back waited for the caller's later work"
        torch.cuda.synchronize()
    assert torch.equal(got.cpu(), reference[0])


def test_the_data_plane_process_sees_no_gpu_and_imports_this_package() -> None:
    """The child works on host memory: with a GPU visible, its pinned receive buffers would make a
    CUDA context on GPU 0 for every rank's child (and fail in exclusive-process mode)."""
    from transport.process import _child_env

    env = _child_env()
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__import__("transport").__file__)))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == root
    probe = "import torch, transport; print(torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr
