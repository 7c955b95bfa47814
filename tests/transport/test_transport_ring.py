"""Ring all-reduce results: exact mean, bit-identical members, concurrency, several rings."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import compress
from transport import TcpTransport
from transport.partition import chunk_bounds, segment_bounds
from transport_helpers import run_ring, transports


@pytest.mark.parametrize("g", [1, 2, 3, 5])
def test_mean_is_exact_and_bit_identical(g: int, backend: str) -> None:
    gen = torch.Generator().manual_seed(g)
    lengths = sorted({0, 1, g - 1, g, g + 1, 37, int(torch.randint(100, 3000, (1,), generator=gen))} - {-1})
    with transports(backend=backend, g=g, chunk_bytes=64) as ts:  # 16-element chunks: many pipelined chunks
        for n in lengths:
            xs = [torch.randn(n, generator=gen) * (i + 1) for i in range(g)]
            before = [x.clone() for x in xs]
            outs = run_ring(ts, xs, tag=f"n{n}")
            ref = torch.stack([x.double() for x in xs]).mean(0).float() if n else torch.empty(0)
            for out in outs:
                assert out.dtype == torch.float32 and out.shape == (n,)
                assert torch.equal(out, outs[0]), "members differ"
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            for x, b in zip(xs, before):
                assert torch.equal(x, b), "input buffer changed"


def test_fp32_two_members_is_exact() -> None:
    xs = [torch.randn(1000), torch.randn(1000)]
    with transports(2, chunk_bytes=256) as ts:
        outs = run_ring(ts, xs, tag="exact")
    assert torch.equal(outs[0], (xs[0] + xs[1]) / 2) or torch.equal(outs[0], (xs[1] + xs[0]) / 2)


def test_single_member_goes_through_codec() -> None:
    x = torch.tensor([1.0, 1.0 + 2**-10, 3.0])
    with transports(1) as ts:
        out = ts[0].all_reduce(x, [ts[0].address], 0, tag="g1", codec=compress.get_codec("bf16")).wait()
        exact = ts[0].all_reduce(x, [ts[0].address], 0, tag="g1b").wait()
    assert torch.equal(out, compress.get_codec("bf16").decode(compress.get_codec("bf16").encode(x)))
    assert torch.equal(exact, x) and exact.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
def test_lossy_codec_bit_identical_across_members(name: str, backend: str) -> None:
    codec = compress.get_codec(name)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(5000, generator=gen) for _ in range(3)]
    with transports(backend=backend, g=3, chunk_bytes=1024) as ts:
        outs = run_ring(ts, xs, tag="lossy", codec=codec)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    ref = torch.stack(xs).mean(0)
    assert (outs[0] - ref).abs().max() < 0.25 * ref.abs().max()


def test_concurrent_tags_started_in_different_orders(backend: str) -> None:
    tags = [f"r1/s{k}" for k in range(6)]
    g = 3
    xs = {(tag, i): torch.full((517,), float(i + 10 * k)) for k, tag in enumerate(tags) for i in range(g)}
    with transports(backend=backend, g=g, chunk_bytes=128) as ts:
        ring = [t.address for t in ts]
        handles = {}
        for i, t in enumerate(ts):
            order = tags if i % 2 == 0 else list(reversed(tags))
            for tag in order:
                handles[(tag, i)] = t.all_reduce(xs[(tag, i)], ring, i, tag=tag)
        for k, tag in enumerate(tags):
            outs = [handles[(tag, i)].wait() for i in range(g)]
            for out in outs:
                assert torch.equal(out, torch.full((517,), 1.0 + 10 * k))


def test_two_rings_share_transports(backend: str) -> None:
    with transports(backend=backend, g=4, chunk_bytes=64) as ts:
        ring_a = [ts[0].address, ts[1].address, ts[2].address]
        ring_b = [ts[3].address, ts[1].address, ts[0].address]
        xa = [torch.randn(300) for _ in range(3)]
        xb = [torch.randn(301) for _ in range(3)]
        ha = [ts[i].all_reduce(xa[j], ring_a, j, tag="stripeA") for j, i in enumerate([0, 1, 2])]
        hb = [ts[i].all_reduce(xb[j], ring_b, j, tag="stripeB") for j, i in enumerate([3, 1, 0])]
        outs_a = [h.wait() for h in ha]
        outs_b = [h.wait() for h in hb]
    for outs, xs in ((outs_a, xa), (outs_b, xb)):
        for out in outs:
            assert torch.equal(out, outs[0])
        torch.testing.assert_close(outs[0], torch.stack(xs).mean(0))


def test_many_rounds_reuse_connections_and_count_bytes(backend: str) -> None:
    n, g = 4096, 3
    with transports(backend=backend, g=g, chunk_bytes=4096) as ts:
        for r in range(5):
            run_ring(ts, [torch.randn(n) for _ in range(g)], tag=f"round{r}")
        # the sending and reading threads count a frame's bytes as they finish it, maybe after the
        # collective that took it ended (seen on a loaded machine): give them a moment
        deadline = time.monotonic() + 5.0
        while (sent := sum(t.bytes_sent for t in ts)) != (received := sum(t.bytes_received for t in ts)) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        # Each member sends 2(G-1)/G of the vector per round; frames add a little overhead.
        payload = 5 * g * 2 * (g - 1) / g * n * 4
        assert payload < sent < payload * 1.2
        assert sent == received
        assert all(len(t._links) == 1 for t in ts)


def test_results_match_across_threads_calling_wait_concurrently() -> None:
    with transports(2) as ts:
        ring = [t.address for t in ts]
        h0 = ts[0].all_reduce(torch.ones(10), ring, 0, tag="w")
        h1 = ts[1].all_reduce(torch.ones(10) * 3, ring, 1, tag="w")
        results = []
        threads = [threading.Thread(target=lambda: results.append(h0.wait())) for _ in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert h1.wait().tolist() == [2.0] * 10
        assert all(r.tolist() == [2.0] * 10 for r in results) and h0.done()


def test_argument_validation() -> None:
    with transports(2) as ts:
        ring = [t.address for t in ts]
        with pytest.raises(ValueError):
            ts[0].all_reduce(torch.ones(3, 3), ring, 0, tag="bad")
        with pytest.raises(ValueError):
            ts[0].all_reduce(torch.ones(3, dtype=torch.float64), ring, 0, tag="bad")
        with pytest.raises(ValueError):
            ts[0].all_reduce(torch.ones(3), ring, 1, tag="bad")
        with pytest.raises(ValueError):
            ts[0].all_reduce(torch.ones(3), ring, 0, tag="x" * 300)
    with pytest.raises(ValueError):
        TcpTransport(secret=b"")


def test_segment_and_chunk_bounds_cover_the_vector() -> None:
    for n in range(0, 40):
        for g in range(1, 7):
            segs = segment_bounds(n, g)
            assert segs[0][0] == 0 and segs[-1][1] == n
            assert all(a <= b for a, b in segs) and all(segs[k][1] == segs[k + 1][0] for k in range(g - 1))
            assert max(b - a for a, b in segs) - min(b - a for a, b in segs) <= 1
            for a, b in segs:
                cs = chunk_bounds(a, b, 3)
                assert sum(d - c for c, d in cs) == b - a and all(0 < d - c <= 3 for c, d in cs)


@pytest.mark.parametrize("name", ["fp32", "int8"])
def test_on_final_reports_each_element_once_with_its_final_value(name: str, backend: str) -> None:
    """The ranges a ring reports as final (``on_final``) cover the vector once per member, each
    before ``wait()`` returns, and hold then what the mean ends as."""
    codec = compress.get_codec(name)
    gen = torch.Generator().manual_seed(11)
    n, g = 3001, 3
    xs = [torch.randn(n, generator=gen) for _ in range(g)]
    outs = [torch.empty(n) for _ in range(g)]
    seen: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in range(g)]
    with transports(backend=backend, g=g, chunk_bytes=512) as ts:
        ring = [t.address for t in ts]
        handles = [t.all_reduce(x, ring, i, tag="final", codec=codec, out=outs[i],
                                on_final=lambda lo, hi, i=i: seen[i].append((lo, hi, outs[i][lo:hi].clone())))
                   for i, (t, x) in enumerate(zip(ts, xs))]
        for h in handles:
            h.wait()
    for i in range(g):
        ranges = sorted((lo, hi) for lo, hi, _ in seen[i])
        assert len(ranges) > g, "one range per segment at least: chunks are reported as they land"
        assert [lo for lo, _ in ranges] == [0] + [hi for _, hi in ranges[:-1]] and ranges[-1][1] == n
        for lo, hi, values in seen[i]:
            assert torch.equal(values, outs[i][lo:hi])
        assert torch.equal(outs[i], outs[0])
