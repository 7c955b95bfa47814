"""Streaming DiLoCo invariants: fragments, schedule, overlap, eager, delayed, CO2."""

import pytest
import torch
import torch.nn as nn
from diloco_helpers import build_in_threads, run_in_threads

from diloco.demo.model import GPT, GPTConfig
from diloco.engine.averaging import Done, InProcessGroups, SingleGroup
from diloco.engine.diloco import DiLoCo
from diloco.engine.fragments import assign_blocks, gpt_fragments, partition
from diloco.engine.outer import CO2Outer, co2, nesterov
from diloco.engine.schedule import QSRSchedule, inner_lr
from diloco.engine.streaming import StreamingDiLoCo, first_syncs

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def batch(group, step):
    """Counting sequences (next token = token + 1 mod 32): learnable, different per group and step."""
    g = torch.Generator().manual_seed(10_000 * group + step)
    x = (torch.randint(0, 32, (4, 1), generator=g) + torch.arange(9)) % 32
    return x[:, :-1], x[:, 1:]


def train(engines, steps, lr_fn=None):
    """Run one engine per thread (one per simulated group); returns events per group."""
    events = [[] for _ in engines]

    def work(i):
        e = engines[i]
        for t in range(steps):
            if lr_fn:
                for pg in e.inner_optimizer.param_groups:
                    pg["lr"] = lr_fn(t)
            x, y = batch(i, t)
            e.inner_optimizer.zero_grad()
            e.model(x, y)[1].backward()
            e.inner_optimizer.step()
            for ev in e.step():
                events[i].append((ev, e.fragment_hash(ev.fragment) if ev.kind == "commit" else None))
        e.close()

    run_in_threads(work, len(engines))
    return events


def streaming_groups(n, **kw):
    groups = InProcessGroups(n)
    models = [gpt() for _ in range(n)]  # seeded here: the global RNG is not per thread

    def make(i):
        m = models[i]
        return StreamingDiLoCo(
            m, torch.optim.AdamW(m.parameters(), lr=3e-3), averager=groups.member(i),
            fragments=gpt_fragments(m, kw.get("P", 1)) if "P" in kw else None,
            **{k: v for k, v in kw.items() if k != "P"},
        )

    return build_in_threads(make, n)


# --- fragments ------------------------------------------------------------------------------


def test_strided_and_sequential_block_assignment():
    assert assign_blocks(6, 3, "strided") == [0, 1, 2, 0, 1, 2]
    assert assign_blocks(6, 3, "sequential") == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="cannot fill"):
        assign_blocks(2, 3, "strided")


def test_gpt_fragments_cover_every_parameter_once_and_balance_the_rest():
    m = gpt()
    frags = gpt_fragments(m, 2)
    names = [n for f in frags for n in f]
    assert sorted(names) == sorted(n for n, _ in m.named_parameters()) and len(names) == len(set(names))
    assert any("blocks.0." in n for n in frags[0]) and any("blocks.2." in n for n in frags[0])
    assert all("blocks.1." not in n and "blocks.3." not in n for n in frags[0])
    params = dict(m.named_parameters())
    sizes = [sum(params[n].numel() for n in f) for f in frags]
    assert max(sizes) / min(sizes) < 1.2
    seq = partition(m, 2, blocks="blocks", pattern="sequential")
    assert any("blocks.1." in n for n in seq[0]) and all("blocks.2." not in n for n in seq[0])
    own = partition(m, 2, blocks="blocks", rest="own")
    assert len(own) == 3 and set(own[2]) == {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"}


def test_generic_rule_by_name_pattern():
    model = nn.Sequential()
    model.add_module("embed", nn.Embedding(10, 4))
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
    model.add_module("layers", layers)
    frags = partition(model, 3, block_pattern=r"layers\.(\d+)\.")
    assert "layers.10.weight" in frags[1] and "layers.11.bias" in frags[2] and "layers.2.weight" in frags[2]
    assert sum(len(f) for f in frags) == 25
    with pytest.raises(ValueError, match="no submodule"):
        partition(model, 2, blocks="transformer.h")


# --- schedule -------------------------------------------------------------------------------


def test_fragments_are_staggered_and_each_syncs_once_per_period():
    assert first_syncs(4, 100) == [25, 50, 75, 100]
    engines = streaming_groups(1, P=4, sync_every=8, overlap_steps=1)
    events = train(engines, 24)[0]
    launches = [ev for ev, _ in events if ev.kind == "launch"]
    for k in range(3):
        window = [ev.fragment for ev in launches if 8 * k < ev.inner_step <= 8 * (k + 1)]
        assert sorted(window) == [0, 1, 2, 3], window
    assert [ev.inner_step for ev in launches[:4]] == [2, 4, 6, 8]


def test_qsr_drives_every_fragment_identically_on_every_group():
    lr = lambda t: inner_lr(t, peak=2e-3, warmup_steps=4, total_steps=120)
    sched = QSRSchedule(h_base=8, alpha=0.003, warmup_steps=4, total_steps=120)
    engines = streaming_groups(2, P=2, sync_every=sched, overlap_steps=1)
    events = train(engines, 120, lr_fn=lr)
    steps = [[(ev.fragment, ev.inner_step) for ev, _ in g if ev.kind == "launch"] for g in events]
    assert steps[0] == steps[1]
    f0 = [s for f, s in steps[0] if f == 0]
    gaps = [b - a for a, b in zip(f0, f0[1:])]
    assert gaps[0] == 8 and max(gaps) > 8


# --- invariants -----------------------------------------------------------------------------


def test_streaming_p1_tau0_alpha0_is_bit_identical_to_plain_diloco():
    groups_a, groups_b = InProcessGroups(2), InProcessGroups(2)
    models = [gpt() for _ in range(4)]  # seeded here: the global RNG is not per thread

    def make_plain(i):
        m = models[i]
        return DiLoCo(m, torch.optim.AdamW(m.parameters(), lr=3e-3), sync_every=5,
                      outer_optimizer=nesterov(), averager=groups_a.member(i))

    def make_streaming(i):
        m2 = models[2 + i]
        return StreamingDiLoCo(m2, torch.optim.AdamW(m2.parameters(), lr=3e-3), sync_every=5,
                               overlap_steps=0, merge_alpha=0.0, outer_optimizer=nesterov(),
                               averager=groups_b.member(i))

    plain, streaming = build_in_threads(make_plain, 2), build_in_threads(make_streaming, 2)
    train(plain, 20)
    train(streaming, 20)
    for a, b in zip(plain, streaming):
        for x, y in zip(a.global_params, b.global_params):
            assert torch.equal(x, y)
        for x, y in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(x, y)


def test_every_fragment_commit_leaves_groups_bit_identical():
    engines = streaming_groups(3, P=2, sync_every=6, overlap_steps=1, merge_alpha=0.5)
    events = train(engines, 30)
    commits = [[(ev.fragment, ev.round, h) for ev, h in g if ev.kind == "commit"] for g in events]
    assert len(commits[0]) >= 8
    assert commits[0] == commits[1] == commits[2]
    assert engines[0].global_hash() == engines[1].global_hash() == engines[2].global_hash()


def test_overlap_merges_with_alpha_and_leaves_other_fragments_alone():
    m = gpt()
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    frags = gpt_fragments(m, 2)
    e = StreamingDiLoCo(m, inner, fragments=frags, sync_every=4, overlap_steps=1, merge_alpha=0.5, averager=SingleGroup())
    params = dict(m.named_parameters())
    for t in range(3):  # fragment 0 launches at step 2, commits at step 3
        x, y = batch(0, t)
        inner.zero_grad()
        m(x, y)[1].backward()
        inner.step()
        if t == 2:
            local = {n: params[n].detach().clone() for n in frags[0] + frags[1]}
        events = e.step()
    assert [(ev.fragment, ev.kind) for ev in events] == [(0, "commit")]
    for n in frags[1]:
        assert torch.equal(params[n], local[n]), n
    glob = dict(zip(e.fragments[0].names, e.fragments[0].global_params))
    for n in frags[0]:
        torch.testing.assert_close(params[n].detach(), 0.5 * local[n] + 0.5 * glob[n])


def test_eager_with_one_group_equals_plain_diloco():
    m1, m2 = gpt(), gpt()
    plain = DiLoCo(m1, torch.optim.AdamW(m1.parameters(), lr=3e-3), sync_every=5, averager=SingleGroup())
    eager = StreamingDiLoCo(m2, torch.optim.AdamW(m2.parameters(), lr=3e-3), sync_every=5,
                            mode="eager", merge_alpha=0.0, averager=SingleGroup(),
                            outer_optimizer=nesterov())  # eager's own default is 0.7/0.5
    train([plain], 20)
    train([eager], 20)
    for x, y in zip(plain.global_params, eager.global_params):
        assert torch.equal(x, y)


class ScriptedAverager:
    """Two 'groups': the other group's contribution is a fixed vector."""

    num_groups = 2
    group_index = 0

    def __init__(self, other):
        self.other = other
        self.sent = []

    def start(self, flat, *, tag, exact=False):
        if exact:  # the initial-parameter check: the other group holds the same parameters
            return Done(flat.clone())
        self.sent.append(flat.clone())
        return Done((flat + self.other) / 2)


def test_eager_uses_fresh_own_delta_and_stale_remote_deltas():
    model = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(model.weight)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    other = torch.tensor([1.0, 2.0, 3.0])
    avg = ScriptedAverager(other)
    e = StreamingDiLoCo(model, inner, sync_every=1, mode="eager", merge_alpha=0.0,
                        outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0), averager=avg)
    steps = [torch.tensor([[0.5, 0.0, 0.0]]), torch.tensor([[0.0, 0.25, 0.0]])]
    for s in steps:
        with torch.no_grad():
            model.weight -= s  # an 'inner step' that moves the local weights by -s
        e.step()
    # round 0: eager = own/2 (no remote yet); round 1: (own_1 + (2*mean_0 - own_0)) / 2 = (own_1 + other)/2
    own0, own1 = steps[0][0], steps[1][0]
    expected = -(own0 / 2) - (own1 + other) / 2
    torch.testing.assert_close(e.global_params[0][0], expected)


def test_eager_groups_agree_after_finish():
    engines = streaming_groups(2, P=2, sync_every=6, mode="eager", merge_alpha=0.0)
    train(engines, 24)
    assert engines[0].global_hash() == engines[1].global_hash()


def test_delayed_applies_the_previous_round_average():
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    e = StreamingDiLoCo(model, inner, sync_every=1, mode="delayed", merge_alpha=0.0,
                        outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0), averager=SingleGroup())
    with torch.no_grad():
        model.weight -= torch.tensor([[1.0, 0.0]])
    e.step()  # round 0: nothing has arrived yet -> global unchanged, local reset to it
    assert torch.equal(e.global_params[0], torch.zeros(1, 2))
    assert torch.equal(model.weight.detach(), torch.zeros(1, 2))
    with torch.no_grad():
        model.weight -= torch.tensor([[0.0, 1.0]])
    e.step()  # round 1: applies round 0's delta
    torch.testing.assert_close(e.global_params[0], torch.tensor([[-1.0, 0.0]]))
    e.finish()  # drains round 1's delta
    torch.testing.assert_close(e.global_params[0], torch.tensor([[-1.0, -1.0]]))


# --- CO2 ------------------------------------------------------------------------------------


def test_co2_constant_penalty_matches_the_authors_update():
    p = torch.zeros(3)
    opt = CO2Outer([p], lr=1.0, momentum=0.5, clip=0.0, penalty=2.0)
    grads = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.2, 0.2, 0.2])]
    m = torch.zeros(3)
    ref = torch.zeros(3)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        m = 0.5 * m + g / 2.0  # fairscale-CO2: m.mul_(beta).sub_(p, 1/gap).add_(p_old, 1/gap)
        ref -= m
    torch.testing.assert_close(p, ref)


def test_co2_adaptive_penalty_is_one_at_first_and_grows_with_the_gap():
    p = torch.zeros(4)
    opt = CO2Outer([p], lr=1.0, momentum=0.9, clip=0.0)
    p.grad = torch.ones(4)
    opt.step()
    assert opt.param_groups[0]["last_penalty"] == pytest.approx(1.0)
    p.grad = torch.ones(4) * 0.1  # small new gradient after a big move: strong damping
    opt.step()
    assert opt.param_groups[0]["last_penalty"] == pytest.approx(1 + 2.0 / 0.2)


def test_co2_clip_bounds_the_outer_momentum():
    p = torch.zeros(2)
    opt = CO2Outer([p], lr=1.0, momentum=0.0, clip=0.1, penalty=1.0)
    p.grad = torch.tensor([5.0, -0.05])
    opt.step()
    torch.testing.assert_close(p, torch.tensor([-0.1, 0.05]))


def test_co2_mode_trains_and_groups_agree():
    engines = streaming_groups(2, sync_every=5, mode="co2", merge_alpha=0.0, outer_optimizer=co2(0.7, 0.5))
    model = engines[0].model
    x, y = batch(0, 999)
    with torch.no_grad():
        before = float(model(x, y)[1])
    train(engines, 30)
    assert engines[0].global_hash() == engines[1].global_hash()
    with engines[0].global_weights(), torch.no_grad():
        after = float(model(x, y)[1])
    assert after < before - 0.5


def test_bad_streaming_settings():
    m = gpt()
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="overlap_steps"):
        StreamingDiLoCo(m, inner, fragments=gpt_fragments(m, 4), sync_every=8, overlap_steps=2, averager=SingleGroup())
    with pytest.raises(ValueError, match="mode"):
        StreamingDiLoCo(m, inner, mode="bogus", averager=SingleGroup())
    with pytest.raises(ValueError, match="cover every"):
        StreamingDiLoCo(m, inner, fragments=[["head.weight"]], averager=SingleGroup())
