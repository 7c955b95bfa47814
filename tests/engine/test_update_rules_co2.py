"""CO2's outer step (Sun et al., ICLR 2024, arXiv:2401.16265; docs/algorithms.md §5 [S]/[V code]),
reproduced by the real engine on a hand-computable case.

Rule, identical on every group, at the sync of round t (x_{t,0} = θ_global at the round's start,
x̄_{t,τ} = the groups' mean local model after τ = H inner steps; the engine exchanges
Δ̄(t) = x_{t,0} − x̄_{t,τ}, the same quantity)::

    g(t)  = Δ̄(t−1) = x_{t−1,0} − x̄_{t−1,τ}          (one round stale; round 0 applies nothing)
    Λ(t)  = 1 + η·‖m(t−1)‖ / ‖g(t)‖                  (adaptive staleness-gap penalty: η‖m(t−1)‖ =
                                                    ‖x_{t,0} − x_{t−1,0}‖; Λ = 1 at the first step)
            or a constant c ≥ 1 (the authors' released code, fairscale-CO2 ``co2_gap_penalty``)
    m(t)  = clamp(β·m(t−1) + g(t)/Λ(t), −φ, φ)       (outer-momentum clipping, element-wise)
    x_{t+1,0} = x_{t,0} − η·m(t);   θ_local ← θ_global (α = 0)
    at the end the last mean Δ̄(T) goes through the same step once.

Setting: one scalar w = 0, two groups, inner SGD with lr 1 on scripted gradients, H = 2.
Δ per round: group 0 = [1, 3, 7], group 1 = [3, 5, 9]; means Δ̄ = [2, 4, 8].
"""

from __future__ import annotations

import pytest
from update_rule_helpers import run_scalar_groups

from diloco.engine.outer import CO2Outer, by_mode, co2

GRADS = [[0.5, 0.5, 1.5, 1.5, 3.5, 3.5], [1.0, 2.0, 2.0, 3.0, 4.0, 5.0]]


def run(grads, outer_optimizer, h=2):
    trace, engines = run_scalar_groups("co2", grads, outer_optimizer, h)
    assert trace[0] == trace[1]  # every group applies the same stale mean
    return trace[0], engines


def test_co2_adaptive_penalty_and_clip_by_hand():
    # η = 0.5, β = 0.5, φ = 4:
    #   round 1: g = 2, Λ = 1,                        m = 2                        w = -1
    #   round 2: g = 4, Λ = 1 + 0.5·2/4 = 1.25,        m = 0.5·2 + 4/1.25 = 4.2 → 4  w = -1 - 2 = -3
    #   end:     g = 8, Λ = 1 + 0.5·4/8 = 1.25,        m = 0.5·4 + 8/1.25 = 8.4 → 4  w = -3 - 2 = -5
    trace, engines = run(GRADS, co2(lr=0.5, momentum=0.5, clip=4.0, penalty="adaptive"))
    assert trace == pytest.approx([0.0, -1.0, -3.0, -5.0], abs=1e-6)
    assert engines[0].fragments[0].optimizer.param_groups[0]["last_penalty"] == pytest.approx(1.25)


def test_co2_adaptive_penalty_without_clip_by_hand():
    # η = 0.5, β = 0.5, no clip:
    #   round 1: m = 2                                         w = -1
    #   round 2: Λ = 1.25, m = 1 + 3.2 = 4.2                   w = -1 - 2.1 = -3.1
    #   end:     Λ = 1 + 0.5·4.2/8 = 1.2625, m = 2.1 + 8/1.2625 w = -3.1 - 0.5·m
    m_end = 2.1 + 8 / 1.2625
    trace, _ = run(GRADS, co2(lr=0.5, momentum=0.5, clip=0.0, penalty="adaptive"))
    assert trace == pytest.approx([0.0, -1.0, -3.1, -3.1 - 0.5 * m_end], abs=1e-6)


def test_co2_constant_penalty_is_the_released_code_by_hand():
    # fairscale-CO2: m = β·m + (p_old − p)/gap; p_old -= lr·m.  η = 0.5, β = 0.5, gap = 2, no clip:
    #   round 1: m = 2/2 = 1                 w = -0.5
    #   round 2: m = 0.5 + 4/2 = 2.5         w = -0.5 - 1.25 = -1.75
    #   end:     m = 1.25 + 8/2 = 5.25       w = -1.75 - 2.625 = -4.375
    trace, _ = run(GRADS, co2(lr=0.5, momentum=0.5, clip=0.0, penalty=2.0))
    assert trace == [0.0, -0.5, -1.75, -4.375]


def test_co2_is_the_default_outer_step_of_mode_co2():
    trace, engines = run(GRADS, None)
    assert isinstance(engines[0].fragments[0].optimizer, CO2Outer)
    ref, _ = run(GRADS, by_mode("co2"))
    assert trace == ref
