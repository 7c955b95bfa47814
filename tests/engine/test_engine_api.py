"""One engine, one API: checkpoints in every mode, close()/with, the optimizer hook, initial
parameters made equal or refused, and no silent single-group training."""

import io

import pytest
import torch
import torch.nn as nn
from diloco_helpers import build_in_threads, run_in_threads

from diloco.engine.averaging import InProcessGroups, SingleGroup
from diloco.engine.diloco import MODES, DiLoCo, SyncEvent
from diloco.engine.initial import InitialParamsMismatch
from diloco.engine.outer_state import params_hash
from diloco.engine.outer import co2

G = 2


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(group, step):
    g = torch.Generator().manual_seed(10_000 * group + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def engine_kw(mode):
    kw = {"mode": mode, "sync_every": 6}
    kw["fragments"] = [["0.weight", "0.bias", "4.weight", "4.bias"], ["2.weight", "2.bias"]]
    if mode == "overlap":
        kw["overlap_steps"] = 1
    if mode == "co2":
        kw["outer_optimizer"] = co2()
    return kw


def build(mode, groups, seeds=(0, 0), **extra):
    models = [make_model(s) for s in seeds[:groups.size]]  # seeded here: the global RNG is not per thread

    def make(i):
        m = models[i]
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return DiLoCo(m, opt, averager=groups.member(i), **{**engine_kw(mode), **extra})

    return build_in_threads(make, groups.size)


def train(engines, start, stop, close=False):
    def work(i):
        e = engines[i]
        for t in range(start, stop):
            x, y = batch(i, t)
            e.inner_optimizer.zero_grad()
            nn.functional.mse_loss(e.model(x), y).backward()
            e.inner_optimizer.step()
            out = e.step()
            assert isinstance(out, list) and all(isinstance(ev, SyncEvent) for ev in out)
        if close:
            e.close()

    run_in_threads(work, len(engines))


def roundtrip(obj):
    """Through torch.save / torch.load(weights_only=True), as a checkpoint file would go."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def snapshot(e):
    return {n: p.detach().clone() for n, p in e.model.named_parameters()}, e.global_state_dict()


@pytest.mark.parametrize("mode", MODES)
def test_stop_and_resume_from_a_checkpoint_is_bit_identical_in_every_mode(mode):
    steps, cut = 22, 12  # after step 12 overlap has fragment 1 in flight; eager/delayed/co2 both
    straight = build(mode, InProcessGroups(G))
    train(straight, 0, steps, close=True)

    first = build(mode, InProcessGroups(G))
    train(first, 0, cut)
    saved = []

    def save(i):
        e = first[i]
        saved.append((i, roundtrip({"engine": e.state_dict(), "model": e.model.state_dict(),
                                    "inner": e.inner_optimizer.state_dict()})))

    run_in_threads(save, G)
    saved = dict(saved)
    if mode != "blocking":
        assert any(f["in_flight"] is not None for f in saved[0]["engine"]["fragments"]), "nothing in flight"
    resumed = build(mode, InProcessGroups(G))
    for i, e in enumerate(resumed):
        e.load_state_dict(saved[i]["engine"])
        e.model.load_state_dict(saved[i]["model"])
        e.inner_optimizer.load_state_dict(saved[i]["inner"])
    train(resumed, cut, steps, close=True)
    for a, b in zip(straight, resumed):
        assert a.inner_step == b.inner_step == steps and a.round == b.round
        assert a.global_hash() == b.global_hash()
        for x, y in zip(snapshot(a), snapshot(b)):
            for k in x:
                assert torch.equal(x[k], y[k]), (mode, k)
    assert straight[0].global_hash() == straight[1].global_hash()


def test_state_of_another_mode_or_split_is_refused():
    e = DiLoCo(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), averager=SingleGroup(),
               mode="delayed", sync_every=4)
    other = DiLoCo(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), averager=SingleGroup(),
                   mode="blocking", sync_every=4)
    with pytest.raises(ValueError, match="mode"):
        other.load_state_dict(e.state_dict())
    split = DiLoCo(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), averager=SingleGroup(),
                   mode="delayed", sync_every=4, fragments=2)
    with pytest.raises(ValueError, match="fragments"):
        split.load_state_dict(e.state_dict())


@pytest.mark.parametrize("mode", ["overlap", "eager"])
def test_leaving_the_with_block_lands_exchanges_and_groups_agree(mode):
    engines = build(mode, InProcessGroups(G))

    def work(i):
        with engines[i] as e:
            for t in range(15):
                x, y = batch(i, t)
                e.inner_optimizer.zero_grad()
                nn.functional.mse_loss(e.model(x), y).backward()
                e.inner_optimizer.step()
                e.step()
        assert e.finished and all(f is None for f in e.in_flight)
        for g, p in zip(e.global_params, e.local_params):  # the model holds the global parameters
            assert torch.equal(g, p.detach())

    run_in_threads(work, G)
    assert engines[0].global_hash() == engines[1].global_hash()
    with pytest.raises(RuntimeError, match="after close"):
        engines[0].step()


def test_an_error_inside_the_with_block_does_not_wait_for_peers():
    groups = InProcessGroups(2, timeout_s=30)
    models = [make_model(), make_model()]
    engines = build_in_threads(
        lambda i: DiLoCo(models[i], torch.optim.SGD(models[i].parameters(), lr=0.1), averager=groups.member(i),
                         mode="delayed", sync_every=2), 2)
    e = engines[0]
    with pytest.raises(KeyError):
        with e:
            e.step()
            e.step()  # launches an exchange the other group never joins
            raise KeyError("user code failed")
    assert e.finished and e.in_flight == [None]


def test_hooked_optimizer_runs_the_engine_exactly_like_explicit_steps():
    def run(hook):
        groups = InProcessGroups(G)
        models = [make_model(), make_model()]

        def make(i):
            return DiLoCo(models[i], torch.optim.AdamW(models[i].parameters(), lr=1e-2),
                          averager=groups.member(i), sync_every=5, hook_optimizer=hook)

        engines = build_in_threads(make, G)

        def work(i):
            e = engines[i]
            for t in range(12):
                x, y = batch(i, t)
                nn.functional.mse_loss(e.model(x), y).backward()
                e.inner_optimizer.step()
                e.inner_optimizer.zero_grad()
                if not hook:
                    e.step()
            e.close()

        run_in_threads(work, G)
        return engines

    hooked, explicit = run(True), run(False)
    assert hooked[0].inner_step == 12 and hooked[0].round == 2
    assert hooked[0].global_hash() == explicit[0].global_hash() == hooked[1].global_hash()
    hooked[0].inner_optimizer.step()  # closed: the hook is gone
    assert hooked[0].inner_step == 12


def test_different_initial_weights_are_refused_on_every_group():
    groups = InProcessGroups(G)
    models = [make_model(0), make_model(1)]
    errors = []

    def make(i):
        try:
            DiLoCo(models[i], torch.optim.SGD(models[i].parameters(), lr=0.1), averager=groups.member(i))
        except InitialParamsMismatch as e:
            errors.append((i, str(e)))

    run_in_threads(make, G)
    assert sorted(i for i, _ in errors) == [0, 1]
    assert all("initial_sync='copy'" in msg for _, msg in errors)


def test_initial_sync_copy_gives_every_group_group_0s_parameters_bit_for_bit():
    groups = InProcessGroups(3)
    models = [make_model(s) for s in (0, 1, 2)]
    with torch.no_grad():  # values whose bits a lossy path would change
        next(models[0].parameters())[0, :4] = torch.tensor([-0.0, 1e-40, -3.4e38, 1 / 3])
    want = [p.detach().clone() for p in models[0].parameters()]
    engines = build_in_threads(
        lambda i: DiLoCo(models[i], torch.optim.SGD(models[i].parameters(), lr=0.1), averager=groups.member(i),
                         initial_sync="copy"), 3)
    for e in engines:
        for w, g, p in zip(want, e.global_params, e.model.parameters()):
            assert torch.equal(w.view(torch.int32), g.view(torch.int32))  # bits, so -0.0 counts
            assert torch.equal(w, p.detach())


def test_the_averager_must_be_named():
    m = make_model()
    with pytest.raises(TypeError, match="averager"):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="SingleGroup"):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), averager=None)


def test_integer_fragments_split_any_model():
    m = make_model()
    e = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), averager=SingleGroup(), fragments=2, sync_every=4)
    assert len(e.fragments) == 2
    assert sorted(e.names) == sorted(n for n, _ in m.named_parameters())


class RecordingGroups(InProcessGroups):
    """In-process groups that remember which exchanges were asked to be lossless."""

    def __init__(self, size):
        super().__init__(size)
        self.exact_tags = set()

    def member(self, index):
        member = super().member(index)
        start = member.start

        def recording_start(flat, *, tag, exact=False):
            if exact:
                self.exact_tags.add(tag)
            return start(flat, tag=tag, exact=exact)

        member.start = recording_start
        return member


def test_eager_final_reconcile_of_parameters_is_sent_lossless():
    groups = RecordingGroups(G)
    engines = build("eager", groups)
    train(engines, 0, 8, close=True)
    assert {"f0/final", "f1/final"} <= groups.exact_tags
    assert not any(t.startswith("f0/r") for t in groups.exact_tags)  # pseudo-gradients use the codec


def test_the_global_hash_is_taken_once_per_change_of_the_global_state(monkeypatch):
    # a round's report after its commit and the next quorum ask read one value; the outer step's
    # own pass folds the hash in (streamed_outer), so after a round no pass over the model is made
    from diloco.engine import outer_state

    passes: list[int] = []
    real = outer_state.rows_part
    monkeypatch.setattr(outer_state, "rows_part", lambda pieces: passes.append(1) or real(pieces))
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = DiLoCo(model, opt, averager=SingleGroup(), sync_every=2)
    first = engine.global_hash()
    assert engine.global_hash() == first and len(passes) == 1
    for _ in range(2):  # a round: two inner steps, then its sync changes the global parameters
        model(torch.ones(2, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        engine.step()
    assert engine.round == 1 and len(passes) == 1
    after = engine.global_hash()
    assert after != first and after == engine.global_hash() and len(passes) == 1  # folded into the step
    assert after == params_hash(engine.global_params)  # the state as it is, not a stale one
    engine.load_state_dict(engine.state_dict())
    assert engine.global_hash() == after and len(passes) == 2  # a load is a change: taken anew
