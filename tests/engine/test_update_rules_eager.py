"""The eager update rule (Kale, Douillard, Donchev 2025, arXiv:2502.12996; docs/algorithms.md §4 [S]),
reproduced by the real engine on a hand-computable case.

Rule, per group m of M, at the sync of round t (Δ = θ_global − θ_local, a descent direction)::

    u_m(t) = ( Δ_m(t) + Σ_{m'≠m} Δ_m'(t−1) ) / M          (own share fresh, the others' one round old)
           = Δ̄(t−1) + ( Δ_m(t) − Δ_m(t−1) ) / M           (what the engine computes)
    θ_global,m ← OuterOpt(θ_global,m, u_m(t));  θ_local,m ← θ_global,m   (α = 0: next round starts there)

Round 0 has nothing from the others (Δ(−1) = 0). The paper gives no rule for the end; the engine
waits for the last exchange without applying it and averages the groups' θ_global copies once::

    θ_global ← (1/M) Σ_m θ_global,m

so the last round enters the final model only through the groups' own shares (weight 1/M: with a
linear outer step, eager ends at −8.25 below where blocking ends at −11). Applying the others'
share Δ̄(T) − Δ_m(T)/M through the outer optimizer first was tried and measured worse on the demo
GPT (eval 2.6793 against 2.5417 with Nesterov 0.7/0.9, 2.377 against 2.3631 with 0.7/0.5): one
more momentum step at the end overshoots.

The setting: one scalar parameter w = 0, inner SGD with lr 1 on a scripted gradient, so an inner
step with gradient g moves w by −g and a round's Δ is the sum of its gradients. H = 2.
"""

from __future__ import annotations

import pytest
import torch
from update_rule_helpers import Scalar, run_scalar_groups

from diloco.engine.diloco import DiLoCo
from diloco.engine.outer import nesterov, sgd

run = run_scalar_groups


# Δ per round: group 0 = [1, 2, 4], group 1 = [3, 5, 7]  (means [2, 3.5, 5.5])
GRADS = [[0.5, 0.5, 1.0, 1.0, 2.0, 2.0], [1.0, 2.0, 2.0, 3.0, 3.0, 4.0]]


def test_eager_rule_with_outer_sgd_by_hand():
    trace, _ = run("eager", GRADS, sgd(1.0, 0.0))
    # group 0: u = 1/2 = 0.5; (2 + 3)/2 = 2.5; (4 + 5)/2 = 4.5   -> w = -0.5, -3.0, -7.5
    # group 1: u = 3/2 = 1.5; (5 + 1)/2 = 3.0; (7 + 2)/2 = 4.5   -> w = -1.5, -4.5, -9.0
    # end: the copies are averaged: (-7.5 - 9.0)/2 = -8.25
    assert trace[0] == [-0.5, -3.0, -7.5, -8.25]
    assert trace[1] == [-1.5, -4.5, -9.0, -8.25]
    # blocking with the same linear outer step applies every mean in full: -(2 + 3.5 + 5.5) = -11;
    # eager's total is short of it by the others' half of the last round: (7 + 4)/4 = 2.75
    blocking, _ = run("blocking", GRADS, sgd(1.0, 0.0))
    assert blocking[0] == [-2.0, -5.5, -11.0, -11.0]


def test_eager_rule_feeds_outer_nesterov_by_hand():
    # Nesterov (docs/algorithms.md §0.1), lr 0.5, momentum 0.5: v ← 0.5 v + u;  w ← w − 0.5 (u + 0.5 v)
    trace, engines = run("eager", GRADS, nesterov(0.5, 0.5))
    # group 0, u = 0.5, 2.5, 4.5:
    #   v = 0.5     w = -0.5*(0.5 + 0.25)      = -0.375
    #   v = 2.75    w -= 0.5*(2.5 + 1.375)     -> -2.3125
    #   v = 5.875   w -= 0.5*(4.5 + 2.9375)    -> -6.03125
    # group 1, u = 1.5, 3.0, 4.5:
    #   v = 1.5     w = -0.5*(1.5 + 0.75)      = -1.125
    #   v = 3.75    w -= 0.5*(3.0 + 1.875)     -> -3.5625
    #   v = 6.375   w -= 0.5*(4.5 + 3.1875)    -> -7.40625
    # the final reconcile averages the two global copies: (-6.03125 - 7.40625)/2 = -6.71875
    assert trace[0] == [-0.375, -2.3125, -6.03125, -6.71875]
    assert trace[1] == [-1.125, -3.5625, -7.40625, -6.71875]
    assert torch.equal(engines[0].model.w.detach(), torch.tensor([-6.71875]))


def test_eager_rule_with_three_groups_weighs_each_share_by_one_over_m():
    # H = 1. Δ: group 0 = [3, 6], group 1 = [6, 3], group 2 = [3, 9]; means 4, 6.
    # round 1 for group 0: (6 + 6 + 3)/3 = 5 (the (1/M)·own + (M−1)/M·mean(t−1) mix would give 4.667)
    trace, _ = run("eager", [[3, 6], [6, 3], [3, 9]], sgd(1.0, 0.0), h=1)
    # group 0: u = 3/3 = 1, then 5                  -> -1, -6
    # group 1: u = 6/3 = 2, then (3 + 3 + 3)/3 = 3  -> -2, -5
    # group 2: u = 3/3 = 1, then (9 + 3 + 6)/3 = 6  -> -1, -7
    # end: (-6 - 5 - 7)/3 = -6
    assert trace == [[-1.0, -6.0, -6.0], [-2.0, -5.0, -6.0], [-1.0, -7.0, -6.0]]


def test_eager_merge_alpha_defaults_to_zero():
    _, engines = run("eager", [[1.0, 1.0], [1.0, 1.0]], sgd(1.0, 0.0))
    assert engines[0].merge_alpha == 0.0


@pytest.mark.parametrize("mode", ["eager", "delayed", "co2"])
def test_stale_modes_merge_alpha_defaults_to_zero_and_overlap_to_half(mode):
    from diloco.engine.averaging import SingleGroup

    m = Scalar()
    e = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=1.0), averager=SingleGroup(), sync_every=2, mode=mode)
    assert e.merge_alpha == 0.0
    m2 = Scalar()
    o = DiLoCo(m2, torch.optim.SGD(m2.parameters(), lr=1.0), averager=SingleGroup(), sync_every=2, mode="overlap")
    assert o.merge_alpha == 0.5


class _Pending:
    def __init__(self, value: torch.Tensor, own_share: float | None) -> None:
        self.value, self.own_share = value, own_share

    def wait(self) -> torch.Tensor:
        return self.value


class _QuorumLike:
    """An averager whose exchanges report this group's share of the committed weighted mean, as
    ``QuorumAverager``'s do: every training exchange's mean is ``means.pop(0)``."""

    num_groups = 2
    group_index = 0

    def __init__(self, means: list[float], shares: list[float]) -> None:
        self.means, self.shares = means, shares

    def start(self, flat, *, tag, exact=False, **kw):
        if exact or tag.endswith("/final"):
            return _Pending(flat.clone(), None)
        return _Pending(torch.full_like(flat, self.means.pop(0)), self.shares.pop(0))


@pytest.mark.parametrize("share, expected", [(0.25, -0.5 - (3.0 + 0.25 * (2.0 - 1.0))),  # weighted quorum
                                             (0.0, -0.5 - 3.0)])  # own contribution refused: the mean as is
def test_eager_replaces_exactly_its_own_share_of_a_weighted_mean(share, expected):
    """With weights (or a refusal) this group's part of the previous mean is w_own / sum(w), not
    1/M: u(t) = Δ̄(t−1) + s·(Δ_own(t) − Δ_own(t−1))."""
    model = Scalar()
    avg = _QuorumLike(means=[3.0, 0.0], shares=[share, 0.5])
    e = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=1.0), averager=avg, sync_every=2, mode="eager",
               outer_optimizer=sgd(1.0, 0.0))
    seen = []
    for g in [0.5, 0.5, 1.0, 1.0]:  # Δ(0) = 1, Δ(1) = 2
        model.w.grad = torch.tensor([g])
        e.inner_optimizer.step()
        if e.step():
            seen.append(float(e.global_params[0]))
    assert seen == [-0.5, pytest.approx(expected)]  # round 0: Δ/M = 0.5
