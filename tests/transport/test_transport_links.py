"""Link behaviour: late peers, several connections per peer, shaping."""

from __future__ import annotations

import time

import torch

from transport import TokenBucket
from transport_helpers import BACKENDS, SECRET, closed_port_address, run_ring, transports


def test_peer_that_starts_late_is_dialed_until_it_listens(backend: str) -> None:
    late_addr = closed_port_address()
    host, port = late_addr.rsplit(":", 1)
    with transports(backend=backend, g=2, timeout_s=10) as ts:
        ring = [ts[0].address, ts[1].address, late_addr]
        handles = [t.all_reduce(torch.full((50,), float(i)), ring, i, tag="late") for i, t in enumerate(ts)]
        time.sleep(0.7)
        assert not any(h.done() for h in handles)
        late = BACKENDS[backend](host, int(port), secret=SECRET, timeout_s=10)
        try:
            out = late.all_reduce(torch.full((50,), 2.0), ring, 2, tag="late").wait()
            assert out.tolist() == [1.0] * 50
            assert all(h.wait().tolist() == [1.0] * 50 for h in handles)
        finally:
            late.close()


def test_a_collective_still_dialing_its_peer_ends_when_aborted_not_at_its_deadline(backend: str) -> None:
    """A ring member whose right peer does not listen keeps dialing until the deadline (60 s
    here); aborting it (its group was declared failed, say) ends the dialing at once."""
    from transport import CollectiveAborted

    absent = closed_port_address()
    with transports(backend=backend, g=1, timeout_s=60) as (t,):
        handle = t.all_reduce(torch.ones(50), [t.address, absent], 0, tag="absent")
        time.sleep(0.3)
        assert not handle.done()
        started = time.monotonic()
        handle.abort("the group was declared failed")
        try:
            handle.wait(30)
            raise AssertionError("an aborted collective returned a result")
        except CollectiveAborted as e:
            assert "declared failed" in str(e)
        assert time.monotonic() - started < 2.0


def test_several_connections_per_peer_spread_chunks(backend: str) -> None:
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(10_000, generator=gen) for _ in range(3)]
    with transports(backend=backend, g=3, connections_per_peer=4, chunk_bytes=1024) as ts:
        outs = run_ring(ts, xs, tag="multi")
        for t in ts:
            (link,) = t._links.values()
            assert len(link.conns) == 4
            assert t._incoming_count(next(iter(link.conns)).peer) >= 0
        assert all(t._incoming_count(ts[(i - 1) % 3].address) == 4 for i, t in enumerate(ts))
    for out in outs:
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], torch.stack(xs).mean(0))


def test_shaper_limits_the_send_rate() -> None:
    n = 250_000  # 1 MB; each member sends half of it in a ring of 2
    rate = 2e6
    with transports(2, chunk_bytes=64 << 10) as fast, transports(1, shaper=TokenBucket(rate, 64 << 10), chunk_bytes=64 << 10) as (slow,):
        ring = [fast[0].address, slow.address]
        start = time.monotonic()
        h0 = fast[0].all_reduce(torch.ones(n), ring, 0, tag="shaped")
        h1 = slow.all_reduce(torch.ones(n), ring, 1, tag="shaped")
        h0.wait(), h1.wait()
        elapsed = time.monotonic() - start
    sent = n * 4  # reduce-scatter half + all-gather half
    assert elapsed >= (sent - (64 << 10)) / rate * 0.9


def _settle(expected: int, timeout: float = 5.0) -> int:
    import threading

    deadline = time.monotonic() + timeout
    while threading.active_count() > expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


def test_no_thread_leak_over_many_collectives_and_after_close(backend: str) -> None:
    import threading

    baseline = threading.active_count()
    with transports(backend=backend, g=3, chunk_bytes=1024) as ts:
        run_ring(ts, [torch.ones(1000)] * 3, tag="warm")
        time.sleep(0.5)
        steady = threading.active_count()
        for r in range(20):
            run_ring(ts, [torch.ones(1000)] * 3, tag=f"r{r}")
        assert _settle(steady) <= steady, "collective threads outlive their collectives"
    if backend == "tcp":  # gRPC keeps a few process-wide threads of its own
        assert _settle(baseline) <= baseline, "threads left after close()"


def test_ipv6_loopback(backend: str) -> None:
    import socket

    import pytest

    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    cls = BACKENDS[backend]
    ts = [cls("::1", 0, secret=SECRET, timeout_s=5) for _ in range(2)]
    try:
        assert ts[0].address.startswith("[::1]:")
        outs = run_ring(ts, [torch.ones(9), torch.zeros(9)], tag="v6")
        assert outs[0].tolist() == [0.5] * 9
    finally:
        for t in ts:
            t.close()
