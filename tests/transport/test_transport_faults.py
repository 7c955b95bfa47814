"""Failures: dead peers, missing peers, garbage and truncated streams, deadlines."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch

from transport import CollectiveAborted, TcpTransport
from transport.auth import client_handshake
from transport.wire import HEADER, MAGIC, VERSION, MsgType, pack_header
from transport_helpers import SECRET, closed_port_address, doomed_peer, run_ring, transports


def test_peer_process_killed_mid_transfer_aborts_everyone_within_deadline(backend: str) -> None:
    timeout = 6.0
    n = 1 << 20  # 4 MB; the child's sends are shaped to 2 MB/s, so it dies mid-transfer
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=doomed_peer, args=(child_end, n, 2, 512 << 10, backend), daemon=True)
    proc.start()
    try:
        assert parent_end.poll(60), "child did not start"
        child_addr = parent_end.recv()
        with transports(backend=backend, g=2, timeout_s=timeout, chunk_bytes=64 << 10) as ts:
            ring = [ts[0].address, ts[1].address, child_addr]
            xs = [torch.randn(n), torch.randn(n)]
            before = [x.clone() for x in xs]
            parent_end.send(ring)
            start = time.monotonic()
            handles = [t.all_reduce(x, ring, i, tag="doomed") for i, (t, x) in enumerate(zip(ts, xs))]
            assert parent_end.poll(30)
            assert parent_end.recv() == "killing", "the collective finished before the kill"
            for h in handles:
                with pytest.raises(CollectiveAborted, match="doomed"):
                    h.wait()
                assert time.monotonic() - start < timeout + 2.0
            assert ts[0].bytes_received > 0
            for x, b in zip(xs, before):
                assert torch.equal(x, b)
            # The survivors keep working with each other afterwards.
            outs = run_ring(ts, [torch.ones(10), torch.zeros(10)], tag="after")
            assert outs[0].tolist() == [0.5] * 10
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -9


def test_peer_that_never_shows_aborts_within_timeout(backend: str) -> None:
    timeout = 1.5
    with transports(backend=backend, g=2, timeout_s=timeout) as ts:
        ring = [ts[0].address, ts[1].address, closed_port_address()]
        xs = [torch.ones(100), torch.ones(100)]
        start = time.monotonic()
        handles = [t.all_reduce(x, ring, i, tag="ghost") for i, (t, x) in enumerate(zip(ts, xs))]
        for h in handles:
            with pytest.raises(CollectiveAborted, match="ghost"):
                h.wait()
        assert timeout * 0.9 < time.monotonic() - start < timeout + 1.5
        assert all(torch.equal(x, torch.ones(100)) for x in xs)


def test_wait_timeout_aborts(backend: str) -> None:
    with transports(backend=backend, g=2, timeout_s=30) as ts:
        ring = [t.address for t in ts]
        h = ts[0].all_reduce(torch.ones(5), ring, 0, tag="alone")
        start = time.monotonic()
        with pytest.raises(CollectiveAborted, match="timed out"):
            h.wait(timeout_s=0.5)
        assert time.monotonic() - start < 2.0 and h.done()


def test_per_call_timeout_overrides_default() -> None:
    with transports(2, timeout_s=30) as ts:
        ring = [t.address for t in ts]
        start = time.monotonic()
        with pytest.raises(CollectiveAborted, match="without progress"):
            ts[0].all_reduce(torch.ones(5), ring, 0, tag="late", timeout_s=0.5).wait()
        assert time.monotonic() - start < 2.0


def test_length_mismatch_is_reported(backend: str) -> None:
    with transports(backend=backend, g=2) as ts:
        ring = [t.address for t in ts]
        h0 = ts[0].all_reduce(torch.ones(10), ring, 0, tag="mismatch")
        h1 = ts[1].all_reduce(torch.ones(12), ring, 1, tag="mismatch")
        for h in (h0, h1):
            with pytest.raises(CollectiveAborted, match="length mismatch|aborted by peer"):
                h.wait()


def test_close_aborts_running_collectives(backend: str) -> None:
    with transports(backend=backend, g=2) as ts:
        ring = [t.address for t in ts]
        h = ts[0].all_reduce(torch.ones(5), ring, 0, tag="closing")
        ts[0].close()
        with pytest.raises(CollectiveAborted, match="closed"):
            h.wait(timeout_s=5)


def _fake_left_peer(target: TcpTransport, claimed: str) -> socket.socket:
    """An authenticated raw connection into `target` that claims to be `claimed`."""
    host, port = target.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    client_handshake(s, SECRET, claimed, target.address)
    return s


def _flipped(data: bytes, at: int) -> bytes:
    """``data`` with one bit of byte ``at`` flipped: a payload length one byte longer, or another
    tag, makes a receiver without the envelope's crc wait until its deadline for what never comes."""
    out = bytearray(data)
    out[at] ^= 0x01
    return bytes(out)


def _bad_streams(n: int) -> dict[str, bytes]:
    tag = b"victim"
    good_head = pack_header(MsgType.RS, tag, 0, 0, n, 100)
    return {
        "truncated": good_head + b"\x00" * 10,
        "bad-magic": b"XXXX" + good_head[4:],
        "huge-length": HEADER.pack(MAGIC, VERSION, MsgType.RS, len(tag), 0, 0, n, 1 << 62, 0) + tag,
        "bad-type": HEADER.pack(MAGIC, VERSION, 99, len(tag), 0, 0, n, 0, 0) + tag,
        "flipped-length": _flipped(pack_header(MsgType.RS, tag, 0, 0, n, 100), 31) + bytes(100),
        "flipped-tag": _flipped(pack_header(MsgType.RS, tag, 0, 0, n, 100), HEADER.size + 2) + bytes(100),
        "bad-frame": good_head + os.urandom(100),
        "wrong-index": pack_header(MsgType.RS, tag, 7, 0, n, 4) + b"\x00" * 4,
    }


@pytest.mark.parametrize("kind", list(_bad_streams(1)))
def test_garbage_from_authenticated_peer_aborts_cleanly(kind: str) -> None:
    n = 64
    with transports(2, timeout_s=10) as ts:
        victim, impostor = ts
        ring = [victim.address, impostor.address]  # the impostor's address is the victim's left
        h = victim.all_reduce(torch.ones(n), ring, 0, tag="victim")
        s = _fake_left_peer(victim, impostor.address)
        s.sendall(_bad_streams(n)[kind])
        if kind == "truncated":
            s.close()
        start = time.monotonic()
        with pytest.raises(CollectiveAborted, match="victim"):
            h.wait()
        assert time.monotonic() - start < 3.0
        s.close()
        while victim._incoming_count(impostor.address) and time.monotonic() - start < 5:
            time.sleep(0.01)
        # The victim still serves real peers.
        outs = run_ring(ts, [torch.ones(3), torch.zeros(3)], tag="after")
        assert outs[1].tolist() == [0.5] * 3


def test_garbage_to_listening_port_is_rejected_and_listener_keeps_serving() -> None:
    with transports(2) as ts:
        host, port = ts[0].address.rsplit(":", 1)
        payloads = [
            os.urandom(4096),
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            HEADER.pack(MAGIC, VERSION, MsgType.HELLO, 0, 0, 0, 0, 1 << 40, 0),
            HEADER.pack(MAGIC, VERSION, MsgType.RS, 1, 0, 0, 0, 8, 0) + b"t" + b"\x00" * 8,  # data before auth
        ]
        for p in payloads:
            s = socket.create_connection((host, int(port)), timeout=5)
            try:
                try:
                    s.sendall(p)
                    s.shutdown(socket.SHUT_WR)  # ENOTCONN if the listener already refused and reset us
                    s.settimeout(5)
                    while s.recv(4096):
                        pass  # the server closes: recv returns b"" (or resets)
                except (ConnectionResetError, BrokenPipeError):
                    pass
                except OSError as e:
                    if e.errno != errno.ENOTCONN:
                        raise
            finally:
                s.close()
        # A silent half-open connection must not block other peers either.
        idle = socket.create_connection((host, int(port)), timeout=5)
        try:
            outs = run_ring(ts, [torch.full((7,), 2.0), torch.zeros(7)], tag="ok")
            assert outs[0].tolist() == [1.0] * 7
        finally:
            idle.close()


def test_a_member_that_closes_the_moment_its_collective_returns_does_not_fail_its_neighbour(backend: str) -> None:
    """The first member to finish closes its transport at once (what a job's last round does);
    the other, still reading the last chunks spread over 4 connections, must finish too."""
    import threading

    n = 1 << 20
    for rep in range(6):
        with transports(backend=backend, g=2, connections_per_peer=4, chunk_bytes=64 << 10) as ts:
            ring = [t.address for t in ts]
            xs = [torch.full((n,), float(i + 1)) for i in range(2)]
            results: list = [None, None]

            def member(i: int) -> None:
                try:
                    results[i] = ts[i].all_reduce(xs[i], ring, i, tag=f"last{rep}").wait()
                except Exception as e:  # noqa: BLE001 - reported below
                    results[i] = e
                finally:
                    ts[i].close(flush_timeout_s=5.0)

            threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(30)
            for r in results:
                assert isinstance(r, torch.Tensor), f"rep {rep}: {r!r}"
                assert torch.equal(r, torch.full((n,), 1.5))


def test_a_clean_close_counts_the_peers_connections_open_when_it_closed_not_later() -> None:
    """Of two connections from the left peer, one closes cleanly while the other still carries
    data: the loss event says one was still open, so the collective takes the data queued
    behind it even though, by the time it looks, both have closed. The last one's clean close,
    with a watched connection and none left, is a lost peer."""
    from transport.ring import RingAllReduce
    from transport.ring_collective import _Abort
    from transport.wire import Message

    class Core:
        address = "127.0.0.1:1"
        max_chunk_frame_bytes = 1 << 20

    x = torch.ones(4)
    op = RingAllReduce(Core(), x, ["127.0.0.1:1", "127.0.0.1:2"], 0, "t", None, 5.0, 1024)
    op.watch = {1, 2}
    data = Message(MsgType.RS, "t", 0, 0, 4, b"\0" * 8)
    op.deliver(("lost", "127.0.0.1:2", 1, True, "connection closed by peer", None, (None,)))
    op.deliver(("msg", "127.0.0.1:2", 2, data, None))
    msg, _ = op._next_message(time.monotonic(), lambda: "stalled")
    assert msg is data
    op.deliver(("lost", "127.0.0.1:2", 2, True, "connection closed by peer", None, ()))
    with pytest.raises(_Abort, match="lost the connection from left peer"):
        op._next_message(time.monotonic(), lambda: "stalled")
