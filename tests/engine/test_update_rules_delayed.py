"""The naive one-outer-step delayed update ("1-outer-step delayed", Kale et al. 2025,
arXiv:2502.12996 Table 2; docs/algorithms.md §4 [V]), reproduced by the real engine by hand.

Rule, identical on every group, at the sync of round t (Δ = θ_global − θ_local)::

    u(t) = Δ̄(t−1)                    (the previous round's mean; round 0 applies nothing)
    θ_global ← OuterOpt(θ_global, u(t));  θ_local ← θ_global   (α = 0)
    at the end: θ_global ← OuterOpt(θ_global, Δ̄(T))   (the last mean is applied once)

Setting: one scalar w = 0, two groups, inner SGD with lr 1 on scripted gradients, H = 2.
Δ per round: group 0 = [1, 2, 4], group 1 = [3, 5, 7]; means Δ̄ = [2, 3.5, 5.5].
"""

from __future__ import annotations

from update_rule_helpers import run_scalar_groups

from diloco.engine.outer import by_mode, nesterov, sgd

GRADS = [[0.5, 0.5, 1.0, 1.0, 2.0, 2.0], [1.0, 2.0, 2.0, 3.0, 3.0, 4.0]]


run = run_scalar_groups


def test_delayed_rule_with_outer_sgd_by_hand():
    trace, _ = run("delayed", GRADS, sgd(1.0, 0.0))
    # round 0: nothing; round 1: -2; round 2: -2 - 3.5 = -5.5; end: -5.5 - 5.5 = -11
    assert trace[0] == trace[1] == [0.0, -2.0, -5.5, -11.0]


def test_delayed_rule_feeds_outer_nesterov_by_hand():
    # Nesterov lr 0.5, momentum 0.5 (docs/algorithms.md §0.1) on u = 2, 3.5, then 5.5 at the end:
    #   v = 2     w = -0.5*(2 + 1)          = -1.5
    #   v = 4.5   w -= 0.5*(3.5 + 2.25)     -> -4.375
    #   v = 7.75  w -= 0.5*(5.5 + 3.875)    -> -9.0625
    trace, engines = run("delayed", GRADS, nesterov(0.5, 0.5))
    assert trace[0] == trace[1] == [0.0, -1.5, -4.375, -9.0625]
    assert engines[0].global_hash() == engines[1].global_hash()


def test_delayed_default_outer_optimizer_is_the_modes_own():
    """With no outer optimizer given, ``delayed`` uses ``diloco.engine.outer.by_mode("delayed")`` (a lowered
    outer step that trains; DiLoCo's Nesterov 0.7/0.9 diverges when one round stale)."""
    trace, _ = run("delayed", GRADS, None)
    ref, _ = run("delayed", GRADS, by_mode("delayed"))
    assert trace == ref
    blocking_default, _ = run("delayed", GRADS, nesterov())
    assert trace != blocking_default
