"""The TCP data path's fast parts: reused buffers, in-place fp32 frames, scatter-gather sends."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

import compress
from transport import CollectiveAborted, TcpTransport, TokenBucket
from transport.conn import _sendmsg_all
from transport.frames import raw_fp32
from transport.wire import BufferPool, MsgType, pack_header
from transport_helpers import SECRET, run_ring, transports
from test_transport_faults import _fake_left_peer


class _Opaque:
    """The fp32 codec behind an object the fast path does not recognise: forces decode/encode."""

    def __init__(self) -> None:
        self._c = compress.get_codec("fp32")

    def encode(self, x):
        return self._c.encode(x)

    def decode(self, frame):
        return self._c.decode(frame)

    def encode_with_decoded(self, x):
        return self._c.encode_with_decoded(x)


def test_raw_fp32_only_for_plain_fp32() -> None:
    assert raw_fp32(compress.get_codec("fp32")) is not None
    assert raw_fp32(compress.get_codec("fp32", zstd=True)) is None
    assert raw_fp32(compress.get_codec("bf16")) is None
    assert raw_fp32(_Opaque()) is None


@pytest.mark.parametrize("g", [2, 3])
def test_in_place_fp32_path_is_bit_identical_to_decode_encode(g: int) -> None:
    gen = torch.Generator().manual_seed(g)
    n = 200_003  # several 64 KiB chunks per segment, uneven segments, a short last chunk
    xs = [torch.randn(n, generator=gen) * (i + 1) for i in range(g)]
    before = [x.clone() for x in xs]
    with transports(g, chunk_bytes=64 << 10) as ts:
        for rnd in range(3):  # later rounds run on recycled buffers
            fast = run_ring(ts, xs, tag=f"fast{rnd}")
            slow = run_ring(ts, xs, tag=f"slow{rnd}", codec=_Opaque())
            for out in fast + slow:
                assert torch.equal(out.view(torch.int32), fast[0].view(torch.int32))
    if g == 2:
        assert torch.equal(fast[0], (xs[0] + xs[1]) / 2)
    for x, b in zip(xs, before):
        assert torch.equal(x, b), "input changed"


def test_buffer_pool_reuses_exact_sizes_within_its_cap() -> None:
    pool = BufferPool(max_bytes=3 << 20, min_size=1 << 10)
    a = pool.get(1 << 20)
    assert len(a) == 1 << 20 and not a.readonly
    obj = a.obj
    pool.put(a)
    assert pool.get(1 << 20).obj is obj
    assert pool.get(1 << 20).obj is not obj  # handed out once only
    small = pool.get(100)  # below min_size: never pooled
    pool.put(small)
    assert pool.get(100).obj is not small.obj
    pool.put(memoryview(bytearray(1 << 20))[:1000])  # a slice is not a whole buffer: ignored
    pool.put(b"bytes are not pooled")
    for _ in range(5):
        pool.put(memoryview(bytearray(1 << 20)))
    assert pool._held <= 3 << 20
    pool.put(memoryview(bytearray(2 << 20)))  # another size evicts the old ones to fit
    assert pool._held <= 3 << 20 and len(pool.get(2 << 20)) == 2 << 20


def test_sendmsg_all_survives_partial_writes() -> None:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    bufs = [b"head", bytes(range(256)) * 4096, b"", memoryview(bytearray(b"x" * 70_001)), b"tail"]
    want = b"".join(bytes(x) for x in bufs)
    got = bytearray()

    def read() -> None:
        while len(got) < len(want):
            time.sleep(0.001)  # a slow reader: the writer sees partial sendmsg results
            got.extend(b.recv(8192))

    t = threading.Thread(target=read)
    t.start()
    _sendmsg_all(a, bufs)
    t.join(10)
    a.close()
    b.close()
    assert bytes(got) == want


@pytest.mark.parametrize("kind, reason", [("bad-checksum", "checksum"), ("other-codec", "bf16"), ("wrong-count", "frame holds 31 values, out has room for 32")])
def test_bad_fp32_frames_abort(kind: str, reason: str) -> None:
    n = 64
    fp32 = compress.get_codec("fp32")
    frame = bytearray(fp32.encode(torch.ones(n // 2)))
    if kind == "bad-checksum":
        frame[60] ^= 1
    elif kind == "other-codec":
        frame = bytearray(compress.get_codec("bf16").encode(torch.ones(n // 2)))
    else:
        frame = bytearray(fp32.encode(torch.ones(n // 2 - 1)))
    with transports(2, timeout_s=10) as ts:
        victim, impostor = ts
        ring = [victim.address, impostor.address]
        h = victim.all_reduce(torch.ones(n), ring, 0, tag="victim")
        s = _fake_left_peer(victim, impostor.address)
        s.sendall(pack_header(MsgType.RS, b"victim", 0, 0, n, len(frame)) + frame)
        with pytest.raises(CollectiveAborted, match=reason):
            h.wait(timeout_s=5)
        s.close()


def test_wait_returns_only_once_frames_sent_from_caller_memory_are_gone() -> None:
    """Raw fp32 frames leave straight from x and out; once wait() returns the caller may reuse both.

    Member 0 sends slowly (a token bucket), so its own all-gather frames -- sent from its out
    buffer -- would still be queued when it has everything it needs. Scribbling on x and out right
    after wait() must not reach the other members."""
    n = 3 * 200_000
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=gen) for _ in range(3)]
    expect = (xs[0] + xs[1] + xs[2]) / 3
    outs = [torch.empty(n) for _ in range(3)]
    shapers = [TokenBucket(40e6, 64 << 10), None, None]
    made = [TcpTransport("127.0.0.1", 0, secret=SECRET, timeout_s=10.0, chunk_bytes=64 << 10, shaper=s) for s in shapers]
    try:
        ring = [t.address for t in made]
        for rnd in range(2):
            mine = [x.clone() for x in xs]
            handles = [t.all_reduce(x, ring, i, tag=f"scribble{rnd}", out=o) for i, (t, x, o) in enumerate(zip(made, mine, outs))]
            got = handles[0].wait()
            snapshot = got.clone()
            mine[0].fill_(float("nan"))
            got.fill_(float("nan"))
            for h in handles[1:]:
                assert torch.allclose(h.wait(), expect, atol=1e-6)
            assert torch.allclose(snapshot, expect, atol=1e-6)
    finally:
        for t in made:
            t.close(flush_timeout_s=1.0)
