"""Hostile peers against real listeners on 127.0.0.1: slots, deadlines and memory stay bounded.

Attackers bind other loopback addresses (127.0.0.2, ...) so that the per-source cap can tell
them from the honest members on 127.0.0.1.
"""

from __future__ import annotations

import socket
import time
import tracemalloc
from typing import Iterator

import grpc
import pytest
import torch
import zstandard
from test_transport_faults import _fake_left_peer
from transport_helpers import SECRET, run_ring, transports

import compress
from compress import frame as cframe
from transport import TcpTransport
from transport.grpclink import METHOD
from transport.wire import MsgType, pack_header


def _raw(target: str, source: str = "127.0.0.2") -> socket.socket:
    """A raw TCP connection to target from the loopback address source (never authenticates)."""
    host, port = target.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))


def _closed_by_peer(s: socket.socket, within_s: float) -> bool:
    """Whether the peer closes s (EOF or reset) within within_s seconds."""
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _wait_for(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_slow_loris_tcp_is_cut_at_the_handshake_deadline() -> None:
    with transports(1, handshake_timeout_s=1.0) as (t,):
        s = _raw(t.address)
        hello = pack_header(MsgType.HELLO, b"", 0, 0, 0, 40) + bytes(40)
        start = time.monotonic()
        cut = None
        try:
            for b in hello:  # one byte every 0.3 s: each byte would restart a per-read timeout
                s.sendall(bytes([b]))
                time.sleep(0.3)
        except OSError:
            cut = time.monotonic() - start
        if cut is None:
            assert _closed_by_peer(s, 2.0)
            cut = time.monotonic() - start
        s.close()
        assert 0.9 <= cut < 2.5, f"cut after {cut:.2f} s, deadline 1 s"
        assert t.handshake_timeouts == 1
        assert _wait_for(lambda: t.unauthenticated_connections == 0, 2.0)
        assert 0.9 <= t.longest_unauthenticated_s <= 1.0, "held past the deadline by the listener"


def test_slow_loris_grpc_is_cut_at_the_handshake_deadline() -> None:
    def trickle() -> Iterator[bytes]:
        for b in pack_header(MsgType.HELLO, b"", 0, 0, 0, 40) + bytes(40):
            yield bytes([b])
            time.sleep(0.3)

    with transports(1, "grpc", handshake_timeout_s=1.0) as (t,):
        channel = grpc.insecure_channel(t.address)
        try:
            start = time.monotonic()
            call = channel.stream_stream(METHOD)(trickle(), timeout=10)
            try:
                list(call)
            except grpc.RpcError:
                pass
            took = time.monotonic() - start
        finally:
            channel.close()
        assert took < 3.0, f"the unauthenticated stream lived {took:.2f} s, deadline 1 s"
        assert t.handshake_timeouts == 1


def test_listener_cap_refuses_idle_connections_and_honest_ring_still_runs() -> None:
    with transports(2, max_unauthenticated=4, max_unauthenticated_per_source=100, handshake_timeout_s=5.0) as ts:
        outs = run_ring(ts, [torch.ones(8), torch.zeros(8)], tag="before")
        assert outs[0].tolist() == [0.5] * 8
        idle = [_raw(ts[0].address, f"127.0.0.{2 + i % 5}") for i in range(12)]
        try:
            assert _wait_for(lambda: ts[0].rejected_connections >= 8, 3.0)
            assert ts[0].unauthenticated_connections == 4
            refused = sum(_closed_by_peer(s, 0.2) for s in idle)
            assert refused == 8
            # The members' links are authenticated: they do not count against the cap.
            outs = run_ring(ts, [torch.full((8,), 2.0), torch.zeros(8)], tag="during")
            assert outs[1].tolist() == [1.0] * 8
        finally:
            for s in idle:
                s.close()


def test_per_source_cap_leaves_room_for_other_sources() -> None:
    with transports(2, max_unauthenticated=64, max_unauthenticated_per_source=3, handshake_timeout_s=5.0) as ts:
        flood = [_raw(ts[0].address, "127.0.0.2") for _ in range(10)]
        other = [_raw(ts[0].address, "127.0.0.3") for _ in range(2)]
        try:
            assert _wait_for(lambda: ts[0].rejected_connections >= 7, 3.0)
            assert _wait_for(lambda: ts[0].unauthenticated_connections == 5, 3.0)
            assert ts[0].rejected_connections == 7
            # Honest members (127.0.0.1) dial fresh connections during the flood.
            outs = run_ring(ts, [torch.ones(8), torch.full((8,), 3.0)], tag="flood")
            assert outs[0].tolist() == [2.0] * 8
        finally:
            for s in flood + other:
                s.close()
        assert _wait_for(lambda: ts[0].unauthenticated_connections == 0, 3.0)


def test_members_keep_reserved_slots_when_strangers_fill_the_listener() -> None:
    """Strangers from many addresses fill every shared slot; a member still connects at once,
    because a collective named it (its host is then known) or it authenticated before."""
    with transports(2, max_unauthenticated=4, max_unauthenticated_per_source=2, handshake_timeout_s=5.0) as ts:
        flood = [_raw(ts[0].address, f"127.0.0.{2 + i // 2}") for i in range(4)]
        try:
            assert _wait_for(lambda: ts[0].unauthenticated_connections == 4, 3.0)
            assert _closed_by_peer(_raw(ts[0].address, "127.0.0.9"), 1.0)  # the shared pool is full
            assert ts[0].rejected_connections == 1
            ring = [t.address for t in ts]
            start = time.monotonic()
            # member 0 learns its ring before member 1 dials it: member 1's first dial gets in
            hs = [ts[0].all_reduce(torch.ones(8), ring, 0, tag="t"), ts[1].all_reduce(torch.full((8,), 3.0), ring, 1, tag="t")]
            outs = [h.wait() for h in hs]
            assert all(o.tolist() == [2.0] * 8 for o in outs)
            assert time.monotonic() - start < 2.0, "a member waited for a stranger's slot to expire"
            assert ts[0].rejected_connections == 1
            # a member's address has its own slots, outside the shared cap, capped per source
            mine = [_raw(ts[0].address, "127.0.0.1") for _ in range(10)]
            try:
                assert _wait_for(lambda: ts[0].unauthenticated_connections == 4 + 8, 3.0)
                assert _wait_for(lambda: ts[0].rejected_connections == 1 + 2, 3.0)
            finally:
                for s in mine:
                    s.close()
        finally:
            for s in flood:
                s.close()


@pytest.mark.parametrize("started", [True, False], ids=["running-tag", "unknown-tag"])
def test_huge_payload_claim_is_refused_before_allocating(started: bool) -> None:
    n = 64
    with transports(2, timeout_s=5.0) as (victim, impostor):
        ring = [victim.address, impostor.address]
        h = victim.all_reduce(torch.ones(n), ring, 0, tag="victim") if started else None
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            s = _fake_left_peer(victim, impostor.address)
            tag = b"victim" if started else b"never"
            s.sendall(pack_header(MsgType.RS, tag, 0, 0, n, 200 << 20))  # 200 MiB announced, none sent
            assert _closed_by_peer(s, 3.0), "the connection announcing 200 MiB must be closed"
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
            s.close()
        assert peak < 8 << 20, f"{peak} bytes allocated after a 200 MiB claim"
        if h is not None:
            with pytest.raises(Exception, match="lost the connection|announces"):
                h.wait(timeout_s=5)


def _zstd_bomb_frame(count: int) -> bytes:
    """A small fp32+zstd frame of `count` zero values (streamed: never holds the raw bytes)."""
    raw_len = 4 * count
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=raw_len)
    zero = bytes(1 << 20)
    packed = b"".join(cobj.compress(zero) for _ in range(raw_len // len(zero))) + cobj.flush()
    codec = compress.get_codec("fp32")
    head = cframe.pack_header(cframe.Header(codec.codec_id, cframe.FLAG_ZSTD, *codec.header_params, count, raw_len,
                                            len(packed)))
    return head + packed + cframe.trailer(head, packed)


def test_zstd_frame_declaring_2_28_values_is_refused_without_decompressing() -> None:
    bomb = _zstd_bomb_frame(1 << 28)
    assert len(bomb) < 1 << 20
    codec = compress.get_codec("fp32", zstd=True)
    start = time.monotonic()
    with pytest.raises(compress.FrameError, match="declares 268435456 values, want 32"):
        codec.decode(bomb, count=32)
    assert time.monotonic() - start < 0.5
    # Through a collective: the frame is larger than any frame of its chunk, refused at the envelope.
    n = 64
    with transports(2, timeout_s=5.0) as (victim, impostor):
        h = victim.all_reduce(torch.ones(n), [victim.address, impostor.address], 0, tag="bomb",
                              codec=compress.get_codec("fp32", zstd=True))
        s = _fake_left_peer(victim, impostor.address)
        start = time.monotonic()
        s.sendall(pack_header(MsgType.RS, b"bomb", 0, 0, n, len(bomb)) + bomb)
        with pytest.raises(Exception, match="announces"):
            h.wait(timeout_s=5)
        assert time.monotonic() - start < 0.5
        s.close()


def test_pending_buffers_for_unknown_tags_are_bounded_in_bytes_and_time() -> None:
    frame = compress.get_codec("fp32").encode(torch.ones(1024))  # ~4 KiB
    with transports(2, chunk_bytes=4096, max_pending_bytes=32 << 10, pending_ttl_s=1.0) as (victim, impostor):
        s = _fake_left_peer(victim, impostor.address)
        try:
            for i in range(40):
                s.sendall(pack_header(MsgType.RS, f"never-{i}".encode(), 0, 0, 1024, len(frame)) + frame)
            assert _wait_for(lambda: victim.dropped_pending_messages > 0, 3.0)
            assert 0 < victim.pending_bytes <= 32 << 10
            # Nothing starts those tags: after pending_ttl_s they are forgotten without new traffic.
            assert _wait_for(lambda: victim.pending_bytes == 0, 3.5)
        finally:
            s.close()
        # Once the fake peer's connection is gone, an honest collective still runs.
        assert _wait_for(lambda: victim._incoming_count(impostor.address) == 0, 3.0)
        outs = run_ring([victim, impostor], [torch.ones(8), torch.zeros(8)], tag="honest")
        assert outs[0].tolist() == [0.5] * 8


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="handshake_timeout_s"):
        TcpTransport(secret=SECRET, handshake_timeout_s=0)
    with pytest.raises(ValueError, match="caps on unauthenticated"):
        TcpTransport(secret=SECRET, max_unauthenticated=0)
    with pytest.raises(ValueError, match="pending_ttl_s"):
        TcpTransport(secret=SECRET, pending_ttl_s=-1)


def test_grpc_caps_unauthenticated_streams() -> None:
    import threading

    hold = threading.Event()

    def idle() -> Iterator[bytes]:
        hold.wait(10)
        return
        yield b""

    # gRPC's Python client cannot choose its source address: these streams come from the members'
    # own address (127.0.0.1), known once the ring ran, so its reserved slots' cap is what holds
    from transport.guard import DEFAULT_MAX_PER_KNOWN_SOURCE as known_cap
    with transports(2, "grpc", max_unauthenticated=3, max_unauthenticated_per_source=100, handshake_timeout_s=5.0) as ts:
        run_ring(ts, [torch.ones(8), torch.zeros(8)], tag="before")
        channel = grpc.insecure_channel(ts[0].address)
        calls = [channel.stream_stream(METHOD)(idle(), timeout=10) for _ in range(known_cap + 3)]
        try:
            assert _wait_for(lambda: ts[0].rejected_connections >= 3, 5.0)
            assert ts[0].unauthenticated_connections == known_cap
            codes = []
            for c in calls:
                if c.done() or _wait_for(c.done, 0.1):
                    codes.append(c.code())
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 3
            outs = run_ring(ts, [torch.full((8,), 4.0), torch.zeros(8)], tag="during")
            assert outs[0].tolist() == [2.0] * 8
        finally:
            hold.set()
            for c in calls:
                c.cancel()
            channel.close()


def test_listener_limits_are_settings_that_reach_the_transport() -> None:
    """--handshake-timeout and the caps are Config settings; make_transport applies them and
    validate() refuses values that would disable them."""
    from diloco.job.config import Config, ConfigError
    from diloco.runtime.rank.endpoint import make_transport

    cfg = Config()
    cfg.transport.handshake_timeout = 0.7
    cfg.transport.max_unauthenticated = 2
    cfg.transport.max_unauthenticated_per_source = 1
    t = make_transport(cfg.validate().transport, SECRET)
    try:
        assert t.handshake_timeout_s == 0.7
        first, second = _raw(t.address, "127.0.0.2"), _raw(t.address, "127.0.0.2")
        try:
            assert _closed_by_peer(second, 1.0)  # one per source
            assert _closed_by_peer(first, 2.0)  # cut at the 0.7 s deadline
            assert t.rejected_connections == 1 and t.handshake_timeouts == 1
        finally:
            first.close()
            second.close()
    finally:
        t.close(flush_timeout_s=1.0)
    cfg.transport.max_unauthenticated = 0
    with pytest.raises(ConfigError, match="--max-unauthenticated"):
        cfg.validate()
