"""Error feedback across groups (sign1, topk): the residual update by hand, what leaves it alone
(rollbacks, refused contributions), bit-identical groups, and checkpoints that resume exactly."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
from diloco_helpers import StaticRing, build_in_threads, run_in_threads

import compress
from diloco.engine.averaging import InProcessGroups
from diloco.engine.diloco import DiLoCo
from diloco.engine.error_feedback import Residuals
from diloco.engine.outer import sparseloco
from diloco.exchange.striped import StripedAverager
from transport import TcpTransport

SECRET = b"test-secret-0123456789"


class _Pending:
    def __init__(self, mean, sent, rejected=False, error=None):
        self.mean, self.sent, self.own_rejected, self.error = mean, sent, rejected, error

    def wait(self):
        if self.error is not None:
            raise self.error
        return self.mean


class _OneGroup:
    """A one-group averager through a codec, that says what it sent (as the real ones do)."""

    error_feedback = True

    def __init__(self, codec, **pending_kw):
        self.codec, self.pending_kw, self.sent_y = codec, pending_kw, []

    def start(self, flat, *, tag, error_feedback=False):
        assert error_feedback
        self.sent_y.append(flat.clone())
        decoded = self.codec.decode(self.codec.encode(flat))
        return _Pending(decoded, decoded, **self.pending_kw)


def test_residual_update_by_hand():
    codec = compress.get_codec("sign1", block_size=4)
    res = Residuals(1)
    avg = _OneGroup(codec)
    d1 = torch.tensor([1.0, -3.0, 2.0, 0.5])
    mean = res.start(avg, 0, d1, tag="f0/r0").wait()
    # one block: scale = mean |y| = 6.5 / 4 = 1.625, every value decodes to ±1.625
    assert mean.tolist() == [1.625, -1.625, 1.625, 1.625]
    assert res.residual[0].tolist() == [-0.625, -1.375, 0.375, -1.125]
    assert d1.tolist() == [1.0, -3.0, 2.0, 0.5], "Δ changed"
    d2 = torch.zeros(4)
    mean2 = res.start(avg, 0, d2, tag="f0/r1").wait()
    assert torch.equal(avg.sent_y[1], torch.tensor([-0.625, -1.375, 0.375, -1.125]))  # y = Δ + e
    # scale = 3.5 / 4 = 0.875
    assert mean2.tolist() == [-0.875, -0.875, 0.875, -0.875]
    assert res.residual[0].tolist() == [0.25, -0.5, -0.5, -0.25]
    # nothing lost: everything decoded plus the residual is everything sent
    assert torch.equal(mean + mean2 + res.residual[0], d1 + d2)


def test_topk_residual_keeps_what_was_not_sent():
    codec = compress.get_codec("topk", chunk=4, k=1, value_bits=1)
    res = Residuals(1)
    d = torch.tensor([0.5, -4.0, 1.0, 2.0])
    mean = res.start(_OneGroup(codec), 0, d, tag="f0/r0").wait()
    assert mean.tolist() == [0.0, -4.0, 0.0, 0.0]
    assert res.residual[0].tolist() == [0.5, 0.0, 1.0, 2.0]


def test_residual_moves_only_when_the_exchange_lands():
    codec = compress.get_codec("sign1", block_size=4)
    res = Residuals(1)
    res.residual[0] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    d = torch.tensor([1.0, -1.0, 2.0, -2.0])
    failing = res.start(_OneGroup(codec, error=RuntimeError("rolled back, never committed")), 0, d, tag="t")
    with pytest.raises(RuntimeError):
        failing.wait()
    assert res.residual[0].tolist() == [0.25] * 4
    refused = res.start(_OneGroup(codec, rejected=True), 0, d, tag="t2")  # the quorum refused our Δ
    refused.wait()
    assert refused.own_rejected and res.residual[0].tolist() == [0.25] * 4
    pending = res.start(_OneGroup(codec), 0, d, tag="t3")
    assert res.residual[0].tolist() == [0.25] * 4, "launching must not touch the residual"
    pending.wait()
    pending.wait()  # a second wait lands nothing again
    assert not torch.equal(res.residual[0], torch.full((4,), 0.25))


def test_a_codec_that_needs_error_feedback_is_refused_without_a_residual():
    groups = InProcessGroups(1, codec=compress.get_codec("sign1"))
    with pytest.raises(ValueError, match="error feedback"):
        groups.member(0).start(torch.ones(4), tag="x")
    assert groups.member(0).start(torch.ones(4), tag="y", exact=True).wait().tolist() == [1.0] * 4
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="eager"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), averager=groups.member(0), mode="eager")


# --- the engine, two groups in threads --------------------------------------------------------------

G = 2


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(group, step):
    g = torch.Generator().manual_seed(10_000 * group + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def build(averagers, mode, **kw):
    models = [make_model() for _ in averagers]
    kw = {"mode": mode, "sync_every": 6, **kw}
    if mode == "overlap":
        kw["overlap_steps"] = 1
    kw.setdefault("fragments", [["0.weight", "0.bias", "4.weight", "4.bias"], ["2.weight", "2.bias"]])

    def make(i):
        opt = torch.optim.AdamW(models[i].parameters(), lr=1e-2)
        return DiLoCo(models[i], opt, averager=averagers[i], **kw)

    return build_in_threads(make, len(averagers))


def train(engines, start, stop, close=False):
    losses = [[] for _ in engines]

    def work(i):
        e = engines[i]
        for t in range(start, stop):
            x, y = batch(i, t)
            e.inner_optimizer.zero_grad()
            loss = nn.functional.mse_loss(e.model(x), y)
            loss.backward()
            losses[i].append(float(loss.detach()))
            e.inner_optimizer.step()
            e.step()
        if close:
            e.close()

    run_in_threads(work, len(engines))
    return losses


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("mode", ["blocking", "overlap", "delayed"])
@pytest.mark.parametrize("codec", ["sign1", "topk"])
def test_checkpoint_round_trip_resumes_bit_identically(mode, codec):
    def groups():
        return InProcessGroups(G, codec=compress.get_codec(codec, **({"chunk": 64, "k": 4} if codec == "topk" else {})))

    steps, cut = 22, 12
    g1 = groups()
    straight = build([g1.member(i) for i in range(G)], mode)
    train(straight, 0, steps, close=True)
    assert straight[0].global_hash() == straight[1].global_hash()

    g2 = groups()
    first = build([g2.member(i) for i in range(G)], mode)
    train(first, 0, cut)
    saved = {}

    def save(i):
        e = first[i]
        saved[i] = roundtrip({"engine": e.state_dict(), "model": e.model.state_dict(),
                              "inner": e.inner_optimizer.state_dict()})

    run_in_threads(save, G)
    residuals = [f["residual"] for f in saved[0]["engine"]["fragments"]]
    assert all(r is not None and r.abs().sum() > 0 for r in residuals), "no residual saved"
    assert not torch.equal(residuals[0], saved[1]["engine"]["fragments"][0]["residual"]), "residuals are per group"
    g3 = groups()
    resumed = build([g3.member(i) for i in range(G)], mode)
    for i, e in enumerate(resumed):
        e.load_state_dict(saved[i]["engine"])
        e.model.load_state_dict(saved[i]["model"])
        e.inner_optimizer.load_state_dict(saved[i]["inner"])
    train(resumed, cut, steps, close=True)
    for a, b in zip(straight, resumed):
        assert a.global_hash() == b.global_hash()
        for p, q in zip(a.error_feedback.residual, b.error_feedback.residual):
            assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["sign1", "topk"])
def test_nothing_is_lost_over_many_rounds(name):
    """sum(decoded) + residual == sum(Δ) after any number of rounds (up to fp32 rounding), while
    without the residual the codec's bias piles up."""
    codec = compress.get_codec(name, **({"chunk": 256, "k": 8} if name == "topk" else {}))
    gen = torch.Generator().manual_seed(3)
    res = Residuals(1)
    total = torch.zeros(1000, dtype=torch.float64)
    got = torch.zeros(1000, dtype=torch.float64)
    plain = torch.zeros(1000, dtype=torch.float64)
    for r in range(30):
        d = torch.randn(1000, generator=gen) * torch.linspace(0.01, 1, 1000) + 0.05
        total += d.double()
        got += res.start(_OneGroup(codec), 0, d, tag=f"r{r}").wait().double()
        plain += codec.decode(codec.encode(d)).double()
    torch.testing.assert_close(got + res.residual[0].double(), total, rtol=0, atol=1e-4)
    assert float((got - total).norm()) < 0.5 * float((plain - total).norm())


def test_striped_averager_over_real_links_keeps_groups_identical():
    """Two groups over TCP, several stripes per rank, sign1: the gather path end to end."""
    codec = compress.get_codec("sign1")
    ts = [TcpTransport("127.0.0.1", 0, secret=SECRET, timeout_s=20, chunk_bytes=4096) for _ in range(G)]
    try:
        ring = StaticRing([t.address for t in ts])
        avgs = [StripedAverager(t, ring, group=g, rank=0, codec=codec, stripes_per_rank=3, timeout_s=20)
                for g, t in enumerate(ts)]
        assert all(a.error_feedback for a in avgs)
        with pytest.raises(ValueError, match="error feedback"):
            avgs[0].start(torch.ones(10), tag="no-residual")
        engines = build(avgs, "blocking", fragments=None)
        losses = train(engines, 0, 24, close=True)
        assert engines[0].global_hash() == engines[1].global_hash()
        assert all(e.error_feedback.residual[0] is not None for e in engines)
        assert not torch.equal(engines[0].error_feedback.residual[0], engines[1].error_feedback.residual[0])
        assert all(torch.isfinite(torch.tensor(ls)).all() for ls in losses)
    finally:
        for t in ts:
            t.close(flush_timeout_s=1.0)


def test_config_takes_sign1_and_topk_and_refuses_the_modes_that_keep_no_residual():
    from diloco.job.config import Config, ConfigError

    cfg = Config()
    cfg.transport.codec = "sign1"
    assert cfg.validate().transport.codec_spec().build().name == "sign1"
    cfg.transport.codec, cfg.transport.codec_block, cfg.transport.topk_density = "topk", 1024, 0.015
    codec = cfg.validate().transport.codec_spec().build()
    assert (codec.name, codec.chunk, codec.k) == ("topk", 1024, 15)
    for mode in ("eager", "dp"):
        cfg.sync.mode = mode
        with pytest.raises(ConfigError, match=f"needs error feedback, which --mode {mode}"):
            cfg.validate()
    cfg = Config()
    cfg.transport.codec, cfg.transport.topk_density = "int8", 0.1
    with pytest.raises(ConfigError, match="--topk-density applies to --codec topk only"):
        cfg.validate()


class _Switching:
    """A one-group averager whose codec can change between launches (``--codec auto``); it keeps
    what it was asked to send and what it delivered (decoded), per exchange."""

    num_groups, group_index = 1, 0

    def __init__(self, codec) -> None:
        self.codec, self.asked, self.delivered = codec, [], []

    @property
    def error_feedback(self) -> bool:
        return bool(getattr(self.codec, "requires_error_feedback", False))

    def set_codec(self, codec) -> None:
        self.codec = codec

    def start(self, flat, *, tag, exact=False, error_feedback=False):
        if exact or self.codec is None:
            decoded = flat.clone()
        else:
            assert error_feedback == self.error_feedback
            decoded = self.codec.decode(self.codec.encode(flat))
        if not exact:
            self.asked.append(flat.clone())
            self.delivered.append(decoded.clone())
        return _Pending(decoded, decoded)


def _recorded_deltas(engine) -> list:
    """The list every Δ the engine computes is appended to, in launch order."""
    deltas = []
    delta_of = engine._delta

    def recorded(frag):
        delta = delta_of(frag)
        deltas.append(delta.clone())  # the engine writes its next Δ into the same vector
        return delta

    engine._delta = recorded
    return deltas


def _inner_step(model, engine, gen) -> None:
    """One inner step of the linear toy task (learn to reverse x) on a batch drawn from ``gen``."""
    x = torch.randn(8, 16, generator=gen)
    engine.inner_optimizer.zero_grad()
    ((model(x) - x.flip(1)) ** 2).mean().backward()
    engine.inner_optimizer.step()


def test_switching_error_feedback_off_sends_the_residual_once_and_on_starts_from_zero():
    """int2 (error-fed) for three rounds, then an exact codec for two, then int2 again: what the
    exchanges delivered adds up to the sum of the Δs once the residual was flushed, and the
    flush goes into the first Δ after the switch only."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    avg = _Switching(compress.get_codec("int2"))
    engine = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), averager=avg, sync_every=4)
    deltas = _recorded_deltas(engine)
    gen = torch.Generator().manual_seed(1)

    def train(steps):
        for _ in range(steps):
            x = torch.randn(8, 16, generator=gen)
            engine.inner_optimizer.zero_grad()
            ((model(x) - x.flip(1)) ** 2).mean().backward()
            engine.inner_optimizer.step()
            engine.step()

    train(12)
    assert len(deltas) == 3 and engine.error_feedback.residual[0] is not None
    owed = engine.error_feedback.residual[0].clone()
    assert float(owed.abs().sum()) > 0
    avg.set_codec(None)
    engine.set_error_feedback(False)
    assert engine.error_feedback is None
    train(8)
    assert len(deltas) == 5
    torch.testing.assert_close(avg.asked[3], deltas[3] + owed)  # the residual, once, in the next Δ
    torch.testing.assert_close(avg.asked[4], deltas[4])
    total = sum(d.double() for d in deltas)
    torch.testing.assert_close(sum(d.double() for d in avg.delivered), total, rtol=0, atol=1e-5)
    avg.set_codec(compress.get_codec("int2"))
    engine.set_error_feedback(True)
    train(4)
    torch.testing.assert_close(avg.asked[5], deltas[5])  # a new residual starts at zero
    assert engine.error_feedback.residual[0] is not None


@pytest.mark.parametrize("decay", [0.0, 0.5, 1.0])
def test_residual_decay_sends_delta_plus_decay_times_the_residual(decay):
    """--residual-decay β: each exchange asks to send Δ + β·e (e what the last one did not deliver),
    and a final codec's exchange sends Δ + β·e once (0: int2 runs without error feedback)."""
    from diloco.engine.schedule import FixedSchedule

    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    avg = _Switching(compress.get_codec("int2"))
    engine = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), averager=avg, residual_decay=decay,
                    sync_every=FixedSchedule(4, total_steps=12), final_codec=compress.get_codec("fp32"))
    deltas = _recorded_deltas(engine)
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        _inner_step(model, engine, gen)
        engine.step()
    engine.close()
    assert len(avg.asked) == 3
    for r in (1, 2):  # round r sends its Δ and β times what round r-1 did not deliver
        left = avg.asked[r - 1] - avg.delivered[r - 1]
        assert float(left.norm()) > 0.1 * float(avg.asked[r - 1].norm())  # int2 leaves a real residual
        torch.testing.assert_close(avg.asked[r], deltas[r] + decay * left, rtol=0, atol=1e-6)


def test_residual_decay_is_refused_out_of_range_and_with_sparselocos_rule():
    model = nn.Linear(64, 64)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"residual_decay must be in \[0, 1\]"):
        DiLoCo(model, sgd, averager=_Switching(compress.get_codec("int2")), sync_every=4, residual_decay=1.5)
    with pytest.raises(ValueError, match="sets the residual's decay itself"):
        DiLoCo(model, sgd, averager=_Switching(compress.get_codec("topk", chunk=4096, k=64)), sync_every=4,
               outer_optimizer=sparseloco(), residual_decay=0.5)
    from diloco.job.config import Config, ConfigError

    for codec, optimizer, decay, message in (("fp32", "nesterov", 0.5, "applies to codecs with error feedback"),
                                             ("auto", "nesterov", 0.5, "auto chooses the codec"),
                                             ("topk", "sparseloco", 0.5, "its residual's decay is --sparseloco-beta"),
                                             ("int2", "nesterov", -0.1, r"must be in \[0, 1\]")):
        cfg = Config()
        cfg.transport.codec, cfg.outer.optimizer, cfg.outer.residual_decay = codec, optimizer, decay
        with pytest.raises(ConfigError, match=message):
            cfg.validate()
    cfg = Config()
    cfg.transport.codec, cfg.outer.residual_decay = "int2", 0.0
    assert cfg.validate().outer.residual_decay == 0.0


def test_sparselocos_rule_refuses_to_stop_error_feedback():
    model = nn.Linear(64, 64)
    engine = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), averager=_Switching(
        compress.get_codec("topk", chunk=4096, k=64)), sync_every=4, outer_optimizer=sparseloco())
    with pytest.raises(ValueError, match="SparseLoCo"):
        engine.set_error_feedback(False)


@pytest.mark.parametrize("final", ["fp32", "int8", None])
def test_a_final_codec_sends_the_residuals_with_the_last_exchange(final):
    """--final-codec: the job's last exchange runs that codec, the residual goes with it, and what
    the exchanges delivered adds up to the sum of the Δs (fp32 exactly; int8 up to its own error,
    no residual of int2's left); without it the last residual stays behind."""
    from diloco.engine.schedule import FixedSchedule

    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    avg = _Switching(compress.get_codec("int2"))
    codec = None if final is None else compress.get_codec(final)
    engine = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), averager=avg,
                    sync_every=FixedSchedule(4, total_steps=12), final_codec=codec)
    deltas = _recorded_deltas(engine)
    gen = torch.Generator().manual_seed(1)
    owed = None
    for t in range(12):
        _inner_step(model, engine, gen)
        if t == 10:
            owed = engine.error_feedback.residual[0].clone()
        engine.step()
    engine.close()
    assert len(deltas) == 3 and float(owed.abs().sum()) > 0
    total = sum(d.double() for d in deltas)
    delivered = sum(d.double() for d in avg.delivered)
    if final is None:
        assert avg.codec.name == "int2" and engine.error_feedback.residual[0] is not None
        left = engine.error_feedback.residual[0].double()
        torch.testing.assert_close(delivered + left, total, rtol=0, atol=1e-5)
        assert float(left.norm()) > 1e-3 * float(total.norm())
        return
    assert avg.codec is codec and engine.error_feedback is None  # the last exchange ran the final codec
    torch.testing.assert_close(avg.asked[2], deltas[2] + owed)  # Δ and the residual, in one frame
    tol = 1e-5 if final == "fp32" else 2e-2 * float(total.abs().max())
    torch.testing.assert_close(delivered, total, rtol=0, atol=tol)


def test_a_final_codec_runs_the_last_round_by_time():
    """Rounds by time (--round-seconds): the last of 3 rounds, however many steps it took, runs the
    final codec with the residual, and what the exchanges delivered adds up to the Δs."""
    from diloco.engine.schedule import TimeRounds

    now = [0.0]
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    avg = _Switching(compress.get_codec("int2"))
    final = compress.get_codec("fp32")
    engine = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), averager=avg,
                    sync_every=TimeRounds(4.0, 3), clock=lambda: now[0], final_codec=final)
    deltas = _recorded_deltas(engine)
    gen = torch.Generator().manual_seed(1)
    codecs = []
    while not engine.rounds_done:
        _inner_step(model, engine, gen)
        now[0] += 1.0
        if any(e.kind == "launch" for e in engine.step()):
            codecs.append(avg.codec.name)
    engine.close()
    assert codecs == ["int2", "int2", "fp32"] and engine.round_steps == [4, 4, 4]
    total = sum(d.double() for d in deltas)
    torch.testing.assert_close(sum(d.double() for d in avg.delivered), total, rtol=0, atol=1e-5)


def test_a_final_codec_is_refused_where_it_cannot_do_its_job():
    from diloco.engine.schedule import FixedSchedule
    from diloco.job.config import Config, ConfigError

    model = nn.Linear(64, 64)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="keeps a residual itself"):
        DiLoCo(model, sgd, averager=_Switching(compress.get_codec("int2")), sync_every=FixedSchedule(4, total_steps=8),
               final_codec=compress.get_codec("sign1"))
    with pytest.raises(ValueError, match="knows its last step"):
        DiLoCo(model, sgd, averager=_Switching(compress.get_codec("int2")), sync_every=4,
               final_codec=compress.get_codec("fp32"))
    with pytest.raises(ValueError, match="SparseLoCo"):
        DiLoCo(model, sgd, averager=_Switching(compress.get_codec("topk", chunk=4096, k=64)),
               sync_every=FixedSchedule(4, total_steps=8), outer_optimizer=sparseloco(),
               final_codec=compress.get_codec("fp32"))
    for change, message in ((dict(final_codec="int2"), "keeps a residual itself"),
                            (dict(final_codec="nope"), "unknown codec"),
                            (dict(final_codec="int8", codec="auto"), "auto chooses the codecs"),
                            (dict(final_codec="int8", mode="eager", codec="int8"), "not eager")):
        cfg = Config()
        cfg.transport.codec = change.get("codec", "int2")
        cfg.transport.final_codec = change["final_codec"]
        cfg.sync.mode = change.get("mode", "blocking")
        with pytest.raises(ConfigError, match=message):
            cfg.validate()


def test_a_final_codec_over_real_links_switches_every_group_at_once_and_keeps_them_identical():
    """Two groups over TCP, sign1 (the gather path) then int8 for the last exchange (the ring):
    every group switches at the same launch, the residuals go out, the groups end identical."""
    from diloco.engine.schedule import FixedSchedule

    final = compress.get_codec("int8")
    ts = [TcpTransport("127.0.0.1", 0, secret=SECRET, timeout_s=20, chunk_bytes=4096) for _ in range(G)]
    try:
        ring = StaticRing([t.address for t in ts])
        avgs = [StripedAverager(t, ring, group=g, rank=0, codec=compress.get_codec("sign1"), stripes_per_rank=3,
                                timeout_s=20) for g, t in enumerate(ts)]
        engines = build(avgs, "blocking", sync_every=FixedSchedule(6, total_steps=24), final_codec=final)
        train(engines, 0, 23)
        assert all(a.codec.name == "sign1" and e.error_feedback is not None for a, e in zip(avgs, engines))
        train(engines, 23, 24, close=True)
        assert all(a.codec is final and not a.error_feedback for a in avgs)
        assert all(e.error_feedback is None for e in engines)
        assert engines[0].global_hash() == engines[1].global_hash()
        assert engines[0].rounds == engines[1].rounds
    finally:
        for t in ts:
            t.close(flush_timeout_s=1.0)
