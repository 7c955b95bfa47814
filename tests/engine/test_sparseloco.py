"""SparseLoCo's outer rule, exactly: y = β·e + Δ, top-k per tile of y, e ← y − sent, θ ← θ − α·mean(sent),
no outer momentum; every group applies the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from diloco_helpers import StaticRing, build_in_threads, run_in_threads

import compress
from diloco.engine.averaging import SingleGroup
from diloco.engine.diloco import DiLoCo
from diloco.engine.error_feedback import Residuals
from diloco.engine.outer import sparseloco
from diloco.engine.outer_spec import by_name
from diloco.engine.schedule import QSRSchedule
from diloco.engine.tiles import TileLayout
from diloco.exchange.striped import StripedAverager
from transport import TcpTransport

SECRET = b"test-secret-0123456789"


class _Pending:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = self.sent = value
        self.own_rejected = False

    def wait(self) -> torch.Tensor:
        return self.value


class OneGroup:
    """One group through a codec: the mean is what it decoded of its own contribution."""

    error_feedback = True
    num_groups, group_index = 1, 0

    def __init__(self, codec) -> None:
        self.codec, self.sent_y = codec, []

    def start(self, flat, *, tag, error_feedback=False, exact=False):
        if exact:
            return _Pending(flat.clone())
        assert error_feedback
        self.sent_y.append(flat.clone())
        return _Pending(self.codec.decode(self.codec.encode(flat)))


def test_the_residual_decays_by_beta_by_hand():
    codec = compress.get_codec("topk", chunk=4, k=1, value_bits=1)
    res = Residuals(1, decay=0.5)
    avg = OneGroup(codec)
    sent = res.start(avg, 0, torch.tensor([0.5, -4.0, 1.0, 2.0]), tag="f0/r0").wait()
    assert sent.tolist() == [0.0, -4.0, 0.0, 0.0] and res.residual[0].tolist() == [0.5, 0.0, 1.0, 2.0]
    sent = res.start(avg, 0, torch.tensor([1.0, 0.0, 0.0, 0.0]), tag="f0/r1").wait()
    assert avg.sent_y[1].tolist() == [1.25, 0.0, 0.5, 1.0]  # Δ + 0.5·e
    assert sent.tolist() == [1.25, 0.0, 0.0, 0.0] and res.residual[0].tolist() == [0.0, 0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="decay"):
        Residuals(1, decay=1.5)


class Square(nn.Module):
    """One 4 x 4 weight: with tile 2, four tiles of 2 x 2, each one chunk of the codec."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4))


def test_one_round_is_plain_sgd_on_the_top_k_of_each_tile():
    model = Square()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    codec = compress.get_codec("topk", chunk=4, k=1, value_bits=1)
    engine = DiLoCo(model, inner, averager=OneGroup(codec), sync_every=1,
                    outer_optimizer=sparseloco(lr=0.5, beta=0.9, tile=2))
    grad = torch.arange(16.0).view(4, 4) - 7.5  # Δ = θ_global − θ_local = grad after one inner step
    model.w.grad = grad.clone()
    inner.step()
    engine.step()
    sent = top1_per_tile(grad)  # the largest |Δ| of each 2 x 2 tile: -7.5, -5.5, 5.5, 7.5
    assert sorted(sent[sent != 0].tolist()) == [-7.5, -5.5, 5.5, 7.5]
    assert torch.equal(engine.fragments[0].global_params[0], -0.5 * sent)  # θ ← θ − α·sent
    assert torch.equal(model.w.detach(), -0.5 * sent)  # α = 0: the local copy adopts it
    tiles = TileLayout([(4, 4)], tile=2)
    assert torch.equal(tiles.from_tiles(engine.error_feedback.residual[0]).view(4, 4), grad - sent)  # e ← y − sent
    # no outer momentum: a second round with Δ = 0 moves θ by α·(top-k of 0.9·e) only
    engine.step()
    second = top1_per_tile(0.9 * (grad - sent))
    assert sorted(second[second != 0].tolist()) == pytest.approx([-0.9 * 6.5, -0.9 * 4.5, 0.9 * 4.5, 0.9 * 6.5])
    assert torch.allclose(engine.fragments[0].global_params[0], -0.5 * (sent + second))


def top1_per_tile(x: torch.Tensor) -> torch.Tensor:
    """The reference: in each 2 x 2 block of ``x``, only its largest |value| kept."""
    out = torch.zeros_like(x)
    for r in range(0, x.shape[0], 2):
        for c in range(0, x.shape[1], 2):
            block = x[r:r + 2, c:c + 2]
            i = int(block.abs().argmax())
            out[r + i // 2, c + i % 2] = block.reshape(-1)[i]
    return out


def test_the_rule_refuses_what_it_cannot_do():
    model = Square()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="needs an averager with error feedback"):
        DiLoCo(model, inner, averager=SingleGroup(), outer_optimizer=sparseloco())
    with pytest.raises(ValueError, match="need the codec's chunk to be 4 values, not 16"):
        DiLoCo(model, inner, averager=OneGroup(compress.get_codec("topk", chunk=16, k=1)),
               outer_optimizer=sparseloco(tile=2))
    with pytest.raises(ValueError, match="takes no outer momentum"):
        by_name("sparseloco", 1.0, 0.9)
    assert by_name("sparseloco", 0.65, 0.0, beta=0.9).error_decay == 0.9
    for bad in ({"lr": 0.0}, {"beta": 1.5}, {"tile": 0}):
        with pytest.raises(ValueError):
            sparseloco(**bad)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(96, 160)  # 160 x 96: edge tiles on both sides
        self.b = nn.Linear(160, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_two_groups_over_real_links_apply_the_same_bits(device):
    """SparseLoCo's defaults (topk 64 of 4096, 64 x 64 tiles, β 0.95, α 1) over the gather path:
    the stripes start at tiles, every group's global copy is bit-identical after every round; on a
    GPU the residual, the tiles' top-k and the decode stay on the device."""
    codec = compress.get_codec("topk")
    ts = [TcpTransport("127.0.0.1", 0, secret=SECRET, timeout_s=20, chunk_bytes=1 << 16) for _ in range(2)]
    try:
        ring = StaticRing([t.address for t in ts])
        avgs = [StripedAverager(t, ring, group=g, rank=0, codec=codec, stripes_per_rank=2, timeout_s=20)
                for g, t in enumerate(ts)]

        torch.manual_seed(0)
        models = [Net() for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())  # the same start (the global RNG is not per thread)
        models = [m.to(device) for m in models]

        def make(g: int) -> DiLoCo:
            return DiLoCo(models[g], torch.optim.AdamW(models[g].parameters(), lr=1e-2), averager=avgs[g],
                          sync_every=3, outer_optimizer=sparseloco())

        engines = build_in_threads(make, 2)
        hashes: list[list[str]] = [[], []]

        def train(g: int) -> None:
            gen = torch.Generator().manual_seed(g)
            engine = engines[g]
            for _ in range(12):
                x = torch.randn(16, 96, generator=gen).to(device)
                loss = (engine.model(x) - x[:, :8]).pow(2).mean()
                engine.inner_optimizer.zero_grad()
                loss.backward()
                engine.inner_optimizer.step()
                if any(e.kind == "commit" for e in engine.step()):
                    hashes[g].append(engine.global_hash())

        run_in_threads(train, 2)
        assert len(hashes[0]) == 4 and hashes[0] == hashes[1]
        assert all(e.tiles is not None and e.error_feedback.decay == 0.95 for e in engines)
        assert not torch.equal(engines[0].error_feedback.residual[0], engines[1].error_feedback.residual[0])
        assert all(e.error_feedback.residual[0].device.type == device for e in engines)
    finally:
        for t in ts:
            t.close(flush_timeout_s=1.0)


def test_two_groups_under_qsr_grow_h_alike_and_stay_identical():
    """SparseLoCo under QSR: H grows as the inner lr decays, every group picks the same H at every
    sync (a pure function of step and lr) and the groups' global copies stay bit-identical."""
    codec = compress.get_codec("topk")
    ts = [TcpTransport("127.0.0.1", 0, secret=SECRET, timeout_s=20, chunk_bytes=1 << 16) for _ in range(2)]
    try:
        ring = StaticRing([t.address for t in ts])
        avgs = [StripedAverager(t, ring, group=g, rank=0, codec=codec, timeout_s=20) for g, t in enumerate(ts)]
        torch.manual_seed(0)
        models = [Net() for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        schedule = QSRSchedule(h_base=2, alpha=1e-2 * 2 ** 0.5)  # H = max(2, 2 * (1e-2 / lr)^2)

        def make(g: int) -> DiLoCo:
            opt = torch.optim.SGD(models[g].parameters(), lr=1e-2)
            return DiLoCo(models[g], opt, averager=avgs[g], sync_every=schedule, outer_optimizer=sparseloco())

        engines = build_in_threads(make, 2)
        periods: list[list[int]] = [[], []]
        hashes: list[list[str]] = [[], []]

        def train(g: int) -> None:
            gen = torch.Generator().manual_seed(g)
            engine = engines[g]
            sched = torch.optim.lr_scheduler.ExponentialLR(engine.inner_optimizer, gamma=0.85)
            for _ in range(16):
                x = torch.randn(16, 96, generator=gen)
                loss = (engine.model(x) - x[:, :8]).pow(2).mean()
                engine.inner_optimizer.zero_grad()
                loss.backward()
                engine.inner_optimizer.step()
                sched.step()
                events = engine.step()
                periods[g] += [e.next_period for e in events if e.kind == "launch"]
                if any(e.kind == "commit" for e in events):
                    hashes[g].append(engine.global_hash())

        run_in_threads(train, 2)
        assert periods[0] == periods[1] and len(set(periods[0])) > 1, periods
        assert periods[0] == sorted(periods[0]), "H grows as the lr decays"
        assert len(hashes[0]) >= 2 and hashes[0] == hashes[1]
    finally:
        for t in ts:
            t.close(flush_timeout_s=1.0)


def test_the_configuration_names_what_sparseloco_needs():
    from diloco.job.config import Config, ConfigError

    cfg = Config()
    cfg.outer.optimizer = "sparseloco"
    with pytest.raises(ConfigError, match="needs a codec with error feedback"):
        cfg.validate()
    cfg.transport.codec = "topk"
    cfg.validate()
    assert (cfg.outer.outer_lr("blocking"), cfg.outer.outer_momentum("blocking")) == (1.0, 0.0)
    cfg.topology.parallel = "fsdp"  # tiles of whole tensors: refused before any rank starts
    with pytest.raises(ConfigError, match="does not hold: use --parallel ddp"):
        cfg.validate()
    for section, name, value, message in [
        ("outer", "momentum", 0.9, "takes no --outer-momentum"), ("sync", "mode", "co2", "runs with --mode blocking"),
        ("transport", "codec_block", 1024, "--codec-block must be 4096"),
        ("transport", "chunk_bytes", 40000, "multiple of 16384"), ("outer", "sparseloco_beta", 1.5, "in \\[0, 1\\]"),
    ]:
        bad = Config()
        bad.outer.optimizer, bad.transport.codec = "sparseloco", "topk"
        setattr(getattr(bad, section), name, value)
        with pytest.raises(ConfigError, match=message):
            bad.validate()


def test_a_checkpoint_holds_the_tile_major_residual_and_resumes_bit_identically():
    codec = compress.get_codec("topk", chunk=4, k=1, value_bits=2)

    def engine_for(model: nn.Module) -> DiLoCo:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        return DiLoCo(model, inner, averager=OneGroup(codec), sync_every=2, outer_optimizer=sparseloco(tile=2))

    def steps(engine: DiLoCo, seeds: range) -> None:
        for seed in seeds:
            engine.model.w.grad = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
            engine.inner_optimizer.step()
            engine.step()

    straight = engine_for(Square())
    steps(straight, range(8))
    first = engine_for(Square())
    steps(first, range(4))
    state = first.state_dict()
    assert state["fragments"][0]["residual"].numel() == 16  # tile-major (4 tiles of 4): what the codec sees
    resumed = engine_for(Square())
    resumed.model.load_state_dict(first.model.state_dict())
    resumed.inner_optimizer.load_state_dict(first.inner_optimizer.state_dict())
    resumed.load_state_dict(state)
    steps(resumed, range(4, 8))
    assert resumed.global_hash() == straight.global_hash()
    assert torch.equal(resumed.error_feedback.residual[0], straight.error_feedback.residual[0])
