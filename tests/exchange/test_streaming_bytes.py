"""Streaming over the real TCP transport: each fragment sync moves ~1/P of a full sync's bytes."""

import torch
from diloco_helpers import StaticRing, run_in_threads

from diloco.demo.model import GPT, GPTConfig
from diloco.engine.fragments import gpt_fragments
from diloco.engine.streaming import StreamingDiLoCo
from diloco.exchange.striped import StripedAverager
from transport import TcpTransport

SECRET = b"s" * 32
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=32)


def bytes_sent_by(work, groups: int) -> list[int]:
    """Run ``work(g, transport, ring)`` for every group on fresh transports; bytes each one sent.

    The counters are read after ``close()``, which flushes queued sends, so they are final.
    """
    transports = [TcpTransport(secret=SECRET, timeout_s=30) for _ in range(groups)]
    ring = StaticRing([t.address for t in transports])
    try:
        run_in_threads(lambda g: work(g, transports[g], ring), groups)
    finally:
        for t in transports:
            t.close()
    return [t.bytes_sent for t in transports]


def test_bytes_per_fragment_sync_are_about_total_over_p():
    P, H, G = 4, 8, 2
    launches = [0] * G
    sizes: list[list[int]] = [[] for _ in range(G)]

    def full_exchange(g, transport, ring):  # the reference: the whole model in one exchange
        torch.manual_seed(0)
        flat = torch.cat([p.detach().reshape(-1) for p in GPT(CFG).parameters()])
        StripedAverager(transport, ring, group=g, rank=0).start(flat, tag="full").wait()

    def seeded_gpt():
        torch.manual_seed(0)
        return GPT(CFG)

    models = [seeded_gpt() for _ in range(G)]  # seeded here: the global RNG is not per thread

    def streaming(g, transport, ring):
        model = models[g]
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        e = StreamingDiLoCo(model, inner, fragments=gpt_fragments(model, P), sync_every=H,
                            overlap_steps=1, averager=StripedAverager(transport, ring, group=g, rank=0))
        sizes[g] = [f.numel for f in e.fragments]
        gen = torch.Generator().manual_seed(g)
        for _ in range(2 * H):
            x = torch.randint(0, 64, (2, 17), generator=gen)
            inner.zero_grad()
            model(x[:, :-1], x[:, 1:])[1].backward()
            inner.step()
            launches[g] += sum(ev.kind == "launch" for ev in e.step())
        e.finish()

    full = bytes_sent_by(full_exchange, G)
    streamed = bytes_sent_by(streaming, G)
    for g in range(G):
        assert launches[g] == 2 * P  # two periods, each fragment once per period
        per_sync = streamed[g] / launches[g]
        assert abs(per_sync - full[g] / P) <= 0.10 * full[g] / P, (per_sync, full[g] / P)
        total = sum(sizes[g])
        for n in sizes[g]:  # and no fragment is much bigger than its share
            assert abs(n - total / P) <= 0.10 * total / P, sizes[g]
