"""all_gather_mean: every member's own frame reaches every member once encoded, the mean is
bit-identical everywhere, each member learns what the others decoded of it; faults abort."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import pytest
import torch

import compress
from transport import CollectiveAborted
from transport.auth import client_handshake
from transport.gather_reduce import mean_over_all
from transport.gather_reduce import reduce_gathered
from transport.partition import chunk_bounds
from transport.wire import MsgType, pack_header
from gather_helpers import doomed_gather_peer
from transport_helpers import SECRET, closed_port_address, transports

CODECS = {
    "sign1": lambda: compress.get_codec("sign1", block_size=64),
    "topk": lambda: compress.get_codec("topk", chunk=128, k=8),
    "fp32": lambda: compress.get_codec("fp32"),
}


def gather(ts, xs, tag, **kw):
    ring = [t.address for t in ts]
    handles = [t.all_gather_mean(x, ring, i, tag=tag, **kw) for i, (t, x) in enumerate(zip(ts, xs))]
    return [h.wait() for h in handles], [h.sent for h in handles]


def reference(codec, xs, chunk_elems, scales=None):
    """What every member must compute: per chunk, each member's decoded frame, summed in order."""
    n = xs[0].numel()
    decoded = [torch.zeros(n) for _ in xs]
    out = torch.zeros(n)
    for a, b in chunk_bounds(0, n, chunk_elems):
        for d, x in zip(decoded, xs):
            d[a:b] = codec.decode(codec.encode(x[a:b].contiguous()))
        mean_over_all([d[a:b] for d in decoded], scales, out[a:b])
    return out, decoded


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("g", [1, 2, 3])
def test_mean_is_the_ordered_sum_and_bit_identical(g: int, name: str, backend: str) -> None:
    codec = CODECS[name]()
    gen = torch.Generator().manual_seed(g)
    with transports(backend=backend, g=g, chunk_bytes=1024) as ts:  # 256-value chunks: many of them
        for n in (0, 1, 255, 257, 3001):
            xs = [torch.randn(n, generator=gen) * (i + 1) for i in range(g)]
            before = [x.clone() for x in xs]
            outs, sents = gather(ts, xs, tag=f"{name}/{n}", codec=codec)
            ref, decoded = reference(codec, xs, 256)
            for i, (out, sent) in enumerate(zip(outs, sents)):
                assert out.dtype == torch.float32 and out.shape == (n,)
                assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (i, "mean differs")
                assert torch.equal(sent, decoded[i]), (i, "sent is not what the others decoded")
            for x, b in zip(xs, before):
                assert torch.equal(x, b), "input changed"


@pytest.mark.parametrize("mean,clip", [("senders", False), ("senders", True), ("all", True)])
@pytest.mark.parametrize("g", [1, 2, 3])
def test_authors_rules_are_bit_identical_on_every_member(g: int, mean: str, clip: bool, backend: str) -> None:
    """topk's other averages (each index over its senders, the median-norm clip) through the real
    gather: every member's result is the same bits, the pure reduction of the decoded chunks."""
    codec = compress.get_codec("topk", chunk=128, k=8, mean=mean, clip_median=clip)
    plain = compress.get_codec("topk", chunk=128, k=8)
    gen = torch.Generator().manual_seed(10 + g)
    with transports(backend=backend, g=g, chunk_bytes=1024) as ts:
        for n in (1, 257, 3001):
            # members' largest values partly at the same indices (the shared bump), partly apart
            bump = torch.zeros(n)
            bump[::7] = 3.0
            xs = [torch.randn(n, generator=gen) * (i + 1) + bump for i in range(g)]
            outs, sents = gather(ts, xs, tag=f"{mean}/{clip}/{n}", codec=codec)
            ref = torch.zeros(n)
            decoded = [torch.zeros(n) for _ in xs]
            for a, b in chunk_bounds(0, n, 256):
                for d, x in zip(decoded, xs):
                    d[a:b] = codec.decode(codec.encode(x[a:b].contiguous()))
                reduce_gathered([d[a:b] for d in decoded], None, ref[a:b], codec)
            for i, (out, sent) in enumerate(zip(outs, sents)):
                assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (i, "mean differs")
                assert torch.equal(sent, decoded[i])
            today, _ = reference(plain, xs, 256)
            if g > 1 and n > 1:
                assert not torch.equal(ref, today), "the rule made no difference"
            elif g == 1:
                assert torch.equal(ref, today)  # one member: its own decoded values either way


@pytest.mark.parametrize("other", [{"mean": "senders"}, {"clip_median": True}])
def test_members_that_average_differently_abort_naming_the_option(other: dict) -> None:
    """A member started with another --topk-mean (or clip) decodes the same frames into another mean:
    its frames say how it averages, and the others refuse them before any state parts."""
    codecs = [compress.get_codec("topk", chunk=128, k=8), compress.get_codec("topk", chunk=128, k=8, **other)]
    with transports(2, timeout_s=10) as ts:
        ring = [t.address for t in ts]
        handles = [t.all_gather_mean(torch.randn(512), ring, i, tag="split", codec=c)
                   for i, (t, c) in enumerate(zip(ts, codecs))]
        for h in handles:
            with pytest.raises(CollectiveAborted, match="same --topk-mean and --topk-clip-median"):
                h.wait()


def test_fp32_gather_of_two_is_the_exact_mean() -> None:
    xs = [torch.randn(1000), torch.randn(1000)]
    with transports(2, chunk_bytes=256) as ts:
        outs, sents = gather(ts, xs, tag="exact")
    assert torch.equal(outs[0], (xs[0] + xs[1]) / 2) and torch.equal(outs[1], outs[0])
    assert torch.equal(sents[0], xs[0]) and torch.equal(sents[1], xs[1])


def test_scales_weight_each_member_in_ring_order(backend: str) -> None:
    codec = CODECS["sign1"]()
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(700, generator=gen) for _ in range(3)]
    scales = [0.5, 1.5, 1.0]
    with transports(backend=backend, g=3, chunk_bytes=1024) as ts:
        outs, _ = gather(ts, xs, tag="weighted", codec=codec, scales=scales)
        zero, _ = gather(ts, xs, tag="zero", codec=codec, scales=[0.0, 1.5, 1.5])
    ref, decoded = reference(codec, xs, 256, scales)
    assert all(torch.equal(o, ref) for o in outs)
    torch.testing.assert_close(ref, (0.5 * decoded[0] + 1.5 * decoded[1] + decoded[2]) / 3)
    assert all(torch.equal(z, zero[0]) for z in zero)
    torch.testing.assert_close(zero[0], (decoded[1] + decoded[2]) / 2)


def quiet_counters(ts, settle_s: float = 0.2, limit_s: float = 10.0) -> list[int]:
    """Every transport's bytes sent, once none has changed for ``settle_s``."""
    deadline = time.monotonic() + limit_s
    last, since = [t.bytes_sent for t in ts], time.monotonic()
    while time.monotonic() - since < settle_s and time.monotonic() < deadline:
        time.sleep(0.02)
        now = [t.bytes_sent for t in ts]
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_traffic_is_g_minus_1_frames_per_member() -> None:
    codec = compress.get_codec("sign1")
    n, g = 1 << 16, 3
    with transports(g, chunk_bytes=1 << 20) as ts:
        ring = [t.address for t in ts]
        for t in ts:  # connect first: handshakes are not part of the count
            for peer in ring:
                if peer != t.address:
                    t.connect(peer)
        before = quiet_counters(ts)  # the accepting sides' handshake answers may still be on their way
        gather(ts, [torch.randn(n) for _ in range(g)], tag="bytes", codec=codec)
        sent = [t.bytes_sent - b for t, b in zip(ts, before)]
    frame = codec.frame_size(n)
    for s in sent:  # (G - 1) frames, each with a small message envelope
        assert (g - 1) * frame <= s <= (g - 1) * (frame + 64)


def test_argument_validation() -> None:
    with transports(2) as ts:
        ring = [t.address for t in ts]
        x = torch.ones(8)
        with pytest.raises(ValueError, match="scales"):
            ts[0].all_gather_mean(x, ring, 0, tag="a", scales=[1.0])
        with pytest.raises(ValueError, match="scales"):
            ts[0].all_gather_mean(x, ring, 0, tag="b", scales=[1.0, -1.0])
        buf = torch.empty(16)
        with pytest.raises(ValueError, match="overlap"):
            ts[0].all_gather_mean(x, ring, 0, tag="c", out=buf[:8], sent=buf[4:12])
        with pytest.raises(ValueError, match="index"):
            ts[0].all_gather_mean(x, ring, 2, tag="d")


def test_member_killed_mid_collective_aborts_everyone_within_deadline(backend: str) -> None:
    timeout = 6.0
    n = 1 << 20  # 4 MB fp32 frames, the child sends at 2 MB/s: it dies mid-transfer
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=doomed_gather_peer, args=(child_end, n, 2, 512 << 10, backend), daemon=True)
    proc.start()
    try:
        assert parent_end.poll(60), "child did not start"
        child_addr = parent_end.recv()
        with transports(backend=backend, g=2, timeout_s=timeout, chunk_bytes=64 << 10) as ts:
            ring = [ts[0].address, ts[1].address, child_addr]
            parent_end.send(ring)
            start = time.monotonic()
            handles = [t.all_gather_mean(torch.randn(n), ring, i, tag="doomed", codec=compress.get_codec("fp32"))
                       for i, t in enumerate(ts)]
            assert parent_end.poll(30)
            assert parent_end.recv() == "killing", "the collective finished before the kill"
            for h in handles:
                with pytest.raises(CollectiveAborted, match="all_gather_mean 'doomed'"):
                    h.wait()
                assert time.monotonic() - start < timeout + 2.0
            outs, _ = gather(ts, [torch.ones(10), torch.zeros(10)], tag="after")  # the survivors go on
            assert outs[0].tolist() == [0.5] * 10
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -9


def test_member_that_never_shows_aborts_within_timeout(backend: str) -> None:
    timeout = 1.5
    with transports(backend=backend, g=2, timeout_s=timeout) as ts:
        ring = [ts[0].address, ts[1].address, closed_port_address()]
        start = time.monotonic()
        handles = [t.all_gather_mean(torch.ones(100), ring, i, tag="ghost", codec=CODECS["sign1"]())
                   for i, t in enumerate(ts)]
        for h in handles:
            with pytest.raises(CollectiveAborted, match="ghost"):
                h.wait()
        assert time.monotonic() - start < timeout + 1.5


def test_frame_longer_than_the_codec_allows_is_refused_before_allocation() -> None:
    codec = CODECS["sign1"]()
    n = 256
    with transports(2, timeout_s=10) as ts:
        victim, impostor = ts
        ring = [victim.address, impostor.address]  # the impostor's address is the victim's left
        h = victim.all_gather_mean(torch.ones(n), ring, 0, tag="victim", codec=codec)
        host, port = victim.address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=5)
        client_handshake(s, SECRET, impostor.address, victim.address)
        too_long = codec.frame_size(n) + (1 << 20)  # more than sign1 can ever need for 256 values
        s.sendall(pack_header(MsgType.GATHER, b"victim", 1, 0, n, too_long) + bytes(64))
        start = time.monotonic()
        with pytest.raises(CollectiveAborted, match="victim"):
            h.wait()
        assert time.monotonic() - start < 3.0
        s.close()
