"""Where results go: caller-owned output buffers, and collectives on GPU tensors."""

from __future__ import annotations

import pytest
import torch

import compress
from transport import TcpTransport
from cuda_helpers import sleep_on_cuda_stream
from transport_helpers import SECRET, run_ring, transports

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_out_buffer_receives_the_same_bits_as_a_fresh_result(backend: str, codec: str) -> None:
    gen = torch.Generator().manual_seed(5)
    n = 100_003
    xs = [torch.randn(n, generator=gen) for _ in range(3)]
    before = [x.clone() for x in xs]
    outs = [torch.full((n,), float("nan")) for _ in xs]
    c = compress.get_codec(codec)
    with transports(3, backend, chunk_bytes=64 << 10) as ts:
        ring = [t.address for t in ts]
        fresh = run_ring(ts, xs, tag="fresh", codec=c)
        for rnd in range(2):  # a reused buffer is overwritten completely
            handles = [t.all_reduce(x, ring, i, tag=f"out{rnd}", codec=c, out=o) for i, (t, x, o) in enumerate(zip(ts, xs, outs))]
            got = [h.wait() for h in handles]
            for g, o, f in zip(got, outs, fresh):
                assert g is o
                assert torch.equal(o.view(torch.int32), f.view(torch.int32))
    for x, b in zip(xs, before):
        assert torch.equal(x, b)


def test_out_buffer_of_a_single_member_ring() -> None:
    with transports(1) as (t,):
        x = torch.randn(1000)
        out = torch.empty(1000)
        got = t.all_reduce(x, [t.address], 0, tag="solo", codec=compress.get_codec("int8"), out=out).wait()
        assert got is out
        assert torch.equal(out, compress.get_codec("int8").encode_with_decoded(x)[1])


def test_unusable_out_buffers_are_refused_before_anything_is_sent() -> None:
    with transports(2) as ts:
        ring = [t.address for t in ts]
        x = torch.randn(2000)
        for bad in (torch.empty(1999), torch.empty(2000, dtype=torch.float64), torch.empty(4000)[::2], x, x[:1000]):
            with pytest.raises(ValueError, match="out must"):
                ts[0].all_reduce(x, ring, 0, tag="bad", out=bad)
        assert ts[0].bytes_sent == 0
        both = torch.randn(4000)
        with pytest.raises(ValueError, match="overlap"):
            ts[0].all_reduce(both[:2000], ring, 0, tag="bad2", out=both[1000:3000])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_pinned_buffers_need_cuda() -> None:
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        TcpTransport("127.0.0.1", 0, secret=SECRET, pin_memory=True)


@cuda
@pytest.mark.parametrize("codec", ["fp32", "int8", "int4"])
def test_gpu_ring_matches_the_cpu_ring_bit_for_bit(codec: str) -> None:
    gen = torch.Generator().manual_seed(9)
    n = 300_001
    xs = [torch.randn(n, generator=gen) for _ in range(3)]
    c = compress.get_codec(codec)
    with transports(3, chunk_bytes=64 << 10) as ts:
        assert all(t._pool.pinned for t in ts)
        on_cpu = run_ring(ts, xs, tag="cpu", codec=c)
        on_gpu = run_ring(ts, [x.cuda() for x in xs], tag="gpu", codec=c)
        outs = [torch.empty(n, device="cuda") for _ in xs]
        ring = [t.address for t in ts]
        handles = [t.all_reduce(x.cuda(), ring, i, tag="gpu-out", codec=c, out=o)
                   for i, (t, x, o) in enumerate(zip(ts, xs, outs))]
        into = [h.wait() for h in handles]
    for a, b, o in zip(on_cpu, on_gpu, into):
        assert b.device.type == "cuda" and o.device.type == "cuda"
        assert torch.equal(a.view(torch.int32), b.cpu().view(torch.int32))
        assert torch.equal(a.view(torch.int32), o.cpu().view(torch.int32))


@cuda
def test_gpu_ring_waits_for_the_callers_stream() -> None:
    """x written on a side stream just before all_reduce: the ring must see the final values."""
    n = 1 << 22
    with transports(2) as ts:
        ring = [t.address for t in ts]
        side = torch.cuda.Stream()
        xs = []
        handles = []
        for i, t in enumerate(ts):
            with torch.cuda.stream(side):
                x = torch.zeros(n, device="cuda")
                for _ in range(20):  # slow enough to still be running when the ring starts
                    x.add_(float(i + 1) / 20)
                xs.append(x)
                handles.append(t.all_reduce(x, ring, i, tag="stream"))
        got = [h.wait() for h in handles]
    expect = torch.full((n,), 1.5)
    for g in got:
        assert torch.allclose(g.cpu(), expect, atol=1e-5)


@cuda
@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_gpu_collective_runs_beside_the_callers_stream_not_behind_it(codec: str) -> None:
    """Work the caller queues after starting a collective (the next inner steps) neither delays
    the collective nor is waited for by it: the ring runs on a side stream of its own."""
    n = 1 << 16
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(n, generator=gen) for _ in range(2)]
    c = compress.get_codec(codec)
    with transports(2) as ts:
        reference = run_ring(ts, xs, tag="cpu", codec=c)
        ring = [t.address for t in ts]
        handles = [t.all_reduce(x.cuda(), ring, i, tag="beside", codec=c) for i, (t, x) in enumerate(zip(ts, xs))]
        sleep_on_cuda_stream(3.0)
        got = [h.wait(timeout_s=60) for h in handles]
        assert not torch.cuda.current_stream().query(), "the collective waited for the caller's later work"
        torch.cuda.synchronize()
    for g, r in zip(got, reference):
        assert torch.equal(g.cpu().view(torch.int32), r.view(torch.int32))
