"""Exactness invariants of the DiLoCo engine (docs/algorithms.md §11 'what is bit-identical and why')."""

import copy

import pytest
import torch
import torch.nn as nn
from diloco_helpers import build_in_threads, run_in_threads

from diloco.engine.averaging import InProcessGroups, SingleGroup
from diloco.engine.diloco import DiLoCo, NonFiniteError
from diloco.engine.outer import nesterov, sgd


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batches(worker, steps, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + worker)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(steps)]


def run_groups(n_groups, steps, h, inner, outer, data_seed=0, **engine_kw):
    """Train n_groups replicas in threads with the engine; returns the engines."""
    groups = InProcessGroups(n_groups)
    models = [make_model() for _ in range(n_groups)]  # seeded here: the global RNG is not per thread

    def make(i):
        m = models[i]
        return DiLoCo(m, inner(m.parameters()), sync_every=h, outer_optimizer=outer,
                      averager=groups.member(i), **engine_kw)

    engines = build_in_threads(make, n_groups)
    def work(i):
        for x, y in batches(i, steps, data_seed):
            e = engines[i]
            e.inner_optimizer.zero_grad()
            nn.functional.mse_loss(e.model(x), y).backward()
            e.inner_optimizer.step()
            e.step()

    run_in_threads(work, n_groups, timeout_s=60)
    return engines


def test_h1_sgd_outer_lr1_equals_synchronous_data_parallel():
    lr, steps, groups = 0.1, 6, 3
    engines = run_groups(groups, steps, 1, lambda p: torch.optim.SGD(p, lr=lr), sgd(1.0, 0.0))
    dp = make_model()
    opt = torch.optim.SGD(dp.parameters(), lr=lr)
    data = [batches(i, steps) for i in range(groups)]
    for t in range(steps):
        opt.zero_grad()
        for i in range(groups):
            x, y = data[i][t]
            (nn.functional.mse_loss(dp(x), y) / groups).backward()
        opt.step()
    for e in engines:
        for g, p in zip(e.global_params, dp.parameters()):
            torch.testing.assert_close(g, p.detach(), rtol=0, atol=1e-6)


def test_outer_lr1_momentum0_equals_parameter_averaging():
    steps, h, groups = 10, 5, 2
    inner = lambda p: torch.optim.AdamW(p, lr=1e-2)
    engines = run_groups(groups, steps, h, inner, sgd(1.0, 0.0))
    # reference: independent replicas with their own AdamW, parameters averaged every h steps
    models = [make_model() for _ in range(groups)]
    opts = [inner(m.parameters()) for m in models]
    data = [batches(i, steps) for i in range(groups)]
    for t in range(steps):
        for i in range(groups):
            x, y = data[i][t]
            opts[i].zero_grad()
            nn.functional.mse_loss(models[i](x), y).backward()
            opts[i].step()
        if (t + 1) % h == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    avg = sum(p.detach() for p in ps) / groups
                    for p in ps:
                        p.copy_(avg)
    for e in engines:
        for g, p in zip(e.global_params, models[0].parameters()):
            torch.testing.assert_close(g, p.detach(), rtol=0, atol=1e-6)


def test_outer_nesterov_is_torch_sgds_rule_in_exactly_rounded_steps():
    """torch's SGD fuses ``a + α·b`` in its vector loop only (not in the loop's tail, which depends
    on the thread split); the engine rounds the product and the sum separately everywhere, so it
    equals that rule written out step by step bit for bit, and torch's within rounding."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = DiLoCo(model, inner, sync_every=2, outer_optimizer=nesterov(0.7, 0.9), averager=SingleGroup())
    ref = [p.detach().clone() for p in model.parameters()]
    ref_opt = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    manual = [p.detach().clone() for p in model.parameters()]
    velocity = [torch.zeros_like(p) for p in manual]
    for x, y in batches(0, 8):
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        if engine.inner_step + 1 == engine.next_sync[0]:
            deltas = [r - p.detach() for r, p in zip(ref, model.parameters())]
            manual_deltas = [m - p.detach() for m, p in zip(manual, model.parameters())]
        if engine.step():
            for r, d in zip(ref, deltas):
                r.grad = d
            ref_opt.step()
            for m, v, d in zip(manual, velocity, manual_deltas):  # docs/algorithms.md §0.1
                v.mul_(0.9).add_(d)
                m.sub_(((v * 0.9).add_(d)).mul_(0.7))
    assert engine.round == 4
    for g, m in zip(engine.global_params, manual):
        assert torch.equal(g, m)
    for g, r in zip(engine.global_params, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-6)


class Quadratic(nn.Module):
    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(3))

    def loss(self, target):
        return ((self.theta - target) ** 2).sum()


@pytest.mark.parametrize("outer", [sgd(1.0, 0.0), nesterov(0.7, 0.9)])
def test_pseudo_gradient_sign_outer_step_lowers_convex_loss(outer):
    target = torch.tensor([3.0, -2.0, 1.0])
    model = Quadratic()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = DiLoCo(model, inner, sync_every=4, outer_optimizer=outer, averager=SingleGroup())
    before = model.loss(target).item()
    delta = None
    for _ in range(4):
        inner.zero_grad()
        model.loss(target).backward()
        inner.step()
        if engine.inner_step == 3:
            delta = engine.pseudo_gradient()
        engine.step()
    # the pseudo-gradient points like a gradient (uphill): global - local = -(progress)
    assert torch.dot(delta, torch.zeros(3) - target) > 0
    with torch.no_grad():
        after = ((engine.global_params[0] - target) ** 2).sum().item()
    assert after < before


def test_inner_optimizer_state_is_local_and_untouched_by_sync():
    engines = run_groups(2, 4, 4, lambda p: torch.optim.AdamW(p, lr=1e-2), nesterov())
    s0 = engines[0].inner_optimizer.state_dict()["state"]
    s1 = engines[1].inner_optimizer.state_dict()["state"]
    # different data -> different moments, and the sync did not average them
    assert not torch.equal(s0[0]["exp_avg"], s1[0]["exp_avg"])
    # global params are bit-identical across groups after the sync
    for a, b in zip(engines[0].global_params, engines[1].global_params):
        assert torch.equal(a, b)


def test_sync_leaves_inner_moments_unchanged():
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = DiLoCo(model, inner, sync_every=3, averager=SingleGroup())
    for i, (x, y) in enumerate(batches(0, 3)):
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        if i < 2:
            assert engine.step() == []
        else:
            before = copy.deepcopy(inner.state_dict())
            assert [e.kind for e in engine.step()] == ["launch", "commit"]
    after = inner.state_dict()
    for k in before["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(before["state"][k][name], after["state"][k][name])


def test_model_holds_global_params_after_sync_and_global_copy_may_live_on_cpu():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = DiLoCo(model, inner, sync_every=2, global_device="cpu", averager=SingleGroup())
    assert all(g.device.type == "cpu" and g.dtype == torch.float32 for g in engine.global_params)
    for x, y in batches(0, 2):
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        engine.step()
    for g, p in zip(engine.global_params, model.parameters()):
        assert torch.equal(g, p.detach())


def test_merge_alpha_blends_local_and_global():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = DiLoCo(model, inner, sync_every=1, merge_alpha=0.5, outer_optimizer=sgd(1.0, 0.0), averager=SingleGroup())
    x, y = batches(0, 1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    inner.step()
    local = [p.detach().clone() for p in model.parameters()]
    engine.step()
    # one group, outer SGD lr 1: global == local, so the blend is the local value
    for l, p in zip(local, model.parameters()):
        torch.testing.assert_close(p.detach(), l)
    with pytest.raises(ValueError, match="merge_alpha"):
        DiLoCo(model, inner, merge_alpha=1.5, averager=SingleGroup())


def test_nan_pseudo_gradient_is_rejected_and_nothing_applied():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = DiLoCo(model, inner, sync_every=1, averager=SingleGroup())
    before = [g.clone() for g in engine.global_params]
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN"):
        engine.step()
    for b, g in zip(before, engine.global_params):
        assert torch.equal(b, g)


def test_state_dict_round_trip_restores_outer_state():
    engines = run_groups(1, 6, 3, lambda p: torch.optim.SGD(p, lr=0.1), nesterov())
    state = engines[0].state_dict()
    fresh_model = make_model(seed=5)
    fresh = DiLoCo(fresh_model, torch.optim.SGD(fresh_model.parameters(), lr=0.1), sync_every=3, averager=SingleGroup())
    fresh.load_state_dict(state)
    assert fresh.round == 2 and fresh.inner_step == 6
    assert fresh.global_hash() == engines[0].global_hash()
    for g, p in zip(fresh.global_params, fresh_model.parameters()):
        assert torch.equal(g, p.detach())
