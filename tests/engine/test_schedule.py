import math

import pytest

from diloco.engine.schedule import (
    FixedSchedule,
    PacedSchedule,
    QSRSchedule,
    fixed_period,
    inner_lr,
    paced_sync_steps,
    qsr_period,
    sync_steps,
)


def cosine_lrs(n, peak=1e-3, warmup=10):
    return [inner_lr(t, peak=peak, warmup_steps=warmup, total_steps=n) for t in range(n)]


def test_fixed_period_is_h_and_capped_by_remaining_steps():
    assert fixed_period(0, h=30) == 30
    assert fixed_period(90, h=30, total_steps=100) == 10
    assert sync_steps(FixedSchedule(30, total_steps=100), [1e-3] * 100) == [30, 60, 90, 100]


def test_qsr_matches_published_examples():
    # docs/algorithms.md §6.2: H_base 4, alpha 0.0175 -> lr 0.008: 4, lr 0.004: 19, lr 0.001: 306
    for lr, expected in [(0.008, 4), (0.004, 19), (0.001, 306)]:
        assert qsr_period(10_000, lr, h_base=4, alpha=0.0175, warmup_steps=100) == expected


def test_qsr_uses_h_base_during_warmup_and_caps_at_remaining():
    assert qsr_period(5, 1e-6, h_base=4, alpha=0.0175, warmup_steps=10) == 4
    assert qsr_period(990, 1e-6, h_base=4, alpha=0.0175, total_steps=1000) == 10
    assert qsr_period(0, 1e-6, h_base=4, alpha=0.0175, h_max=50) == 50


def test_qsr_gamma_changes_growth():
    assert qsr_period(0, 0.001, h_base=1, alpha=0.01, gamma=1.0) == 10
    assert qsr_period(0, 0.001, h_base=1, alpha=0.01, gamma=3.0) == 1000


def test_qsr_alpha_zero_equals_constant_h():
    lrs = cosine_lrs(500)
    assert sync_steps(QSRSchedule(h_base=30, alpha=0.0, total_steps=500), lrs) == sync_steps(
        FixedSchedule(30, total_steps=500), lrs
    )


def test_qsr_grows_h_as_lr_decays():
    lrs = cosine_lrs(2000, peak=1e-3, warmup=50)
    steps = sync_steps(QSRSchedule(h_base=10, alpha=0.005, warmup_steps=50, total_steps=2000), lrs)
    periods = [b - a for a, b in zip([0] + steps, steps)]
    assert steps[-1] == 2000
    assert periods[0] == 10 and max(periods) > 10 * 5
    # every period respects the rule at the lr in force when the round started
    start = 0
    for p in periods:
        lr = lrs[start]
        expected = 10 if start < 50 else max(10, math.floor((0.005 / lr) ** 2))
        assert p == min(expected, 2000 - start)
        start += p


def test_qsr_lr_zero_needs_a_bound():
    with pytest.raises(ValueError, match="unbounded"):
        qsr_period(100, 0.0, h_base=4, alpha=0.01)
    assert qsr_period(100, 0.0, h_base=4, alpha=0.01, total_steps=150) == 50


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_h_rejected(bad):
    with pytest.raises(ValueError):
        fixed_period(0, h=bad)
    with pytest.raises(ValueError):
        qsr_period(0, 1e-3, h_base=bad, alpha=0.1)


def test_inner_lr_warmup_then_cosine_floor():
    assert inner_lr(0, peak=1.0, warmup_steps=10, total_steps=100) == pytest.approx(0.1)
    assert inner_lr(9, peak=1.0, warmup_steps=10, total_steps=100) == pytest.approx(1.0)
    assert inner_lr(10, peak=1.0, warmup_steps=10, total_steps=100) == pytest.approx(1.0)
    assert inner_lr(100, peak=1.0, warmup_steps=10, total_steps=100, min_ratio=0.1) == pytest.approx(0.1)
    assert inner_lr(50, peak=1.0, warmup_steps=0, total_steps=100, schedule="constant") == 1.0


def test_qsr_default_alpha_scales_with_the_peak_lr():
    from diloco.job.config import SyncConfig

    for peak in (1e-4, 4e-3, 0.3):
        s = SyncConfig(schedule="qsr", h=30)
        alpha = s.qsr_alpha_for(peak)
        assert qsr_period(1000, peak, h_base=30, alpha=alpha) == 30
        assert qsr_period(1000, peak / 2, h_base=30, alpha=alpha) in (119, 120)  # 4 x H_base, up to rounding
    # the ViT recipe of the paper (peak 0.008, H_base 4) chose alpha 0.0175; the default gives 0.016
    assert SyncConfig(schedule="qsr", h=4).qsr_alpha_for(0.008) == pytest.approx(0.016)
    assert SyncConfig(schedule="qsr", h=4, qsr_alpha=0.0175).qsr_alpha_for(0.008) == 0.0175


def test_paced_gamma_zero_is_fixed_h_and_a_constant_lr_paces_nothing():
    assert paced_sync_steps(5, 3, 0.0) == (2, 4, 5)  # what fixed H=2 syncs after
    assert paced_sync_steps(8000, 40, 0.0) == tuple(range(200, 8001, 200))
    assert paced_sync_steps(600, 20, 0.5, lr_schedule="constant") == tuple(range(30, 601, 30))


def test_paced_hand_computed_cosine():
    # lr over 4 steps (cosine to 0.1, no warmup): 1, 0.8682, 0.55, 0.2318 (sum 2.65); two syncs
    # split that mass: the first where half of it is reached, after step 2 (1.868 of 2.65)
    assert paced_sync_steps(4, 2, 1.0) == (2, 4)
    # 1/lr: 1, 1.152, 1.818, 4.314 (sum 8.284): half is reached only in the last step, and the
    # first sync takes the step before it
    assert paced_sync_steps(4, 2, -1.0) == (3, 4)
    assert paced_sync_steps(4, 4, -3.0) == (1, 2, 3, 4)  # every step: syncs spread one step apart


def test_paced_periods_grow_as_the_lr_decays_and_keep_the_fixed_budget():
    schedule = PacedSchedule(h=200, total_steps=8000, gamma=0.5)
    points = sync_steps(schedule, [0.0] * 8000)
    periods = [b - a for a, b in zip([0, *points], points)]
    assert len(points) == 40 and points[-1] == 8000  # the syncs fixed H=200 makes
    assert periods[0] == 141 and max(periods) == 439  # from 200 / sqrt(2) ... to ~ 200 x sqrt(10) / 1.4
    assert all(b >= a - 1 for a, b in zip(periods, periods[1:-1]))  # non-decreasing up to rounding
    steeper = sync_steps(PacedSchedule(h=200, total_steps=8000, gamma=1.0), [0.0] * 8000)
    assert steeper[0] < points[0] and len(steeper) == 40


def test_paced_round_started_off_the_plan_lasts_its_planned_period():
    schedule = PacedSchedule(h=200, total_steps=8000, gamma=0.5)
    points = schedule.points
    assert schedule.period(0, 1.0) == points[0]
    assert schedule.period(points[0], 1.0) == points[1] - points[0]
    # a fragment staggered by half a period keeps its offset: its round lasts the period it starts in
    assert schedule.period(points[0] + 50, 1.0) == points[1] - points[0]
    assert schedule.period(7990, 1.0) == 10  # capped by the steps that remain


@pytest.mark.parametrize("bad", [dict(syncs=0), dict(syncs=9), dict(gamma=math.inf), dict(gamma=math.nan)])
def test_paced_refuses_what_cannot_be_planned(bad):
    args = dict(total_steps=8, syncs=2, gamma=0.5, lr_schedule="cosine", min_ratio=0.1) | bad
    with pytest.raises(ValueError):
        paced_sync_steps(**args)


def test_paced_fragments_keep_their_stagger_and_the_fixed_h_count():
    from diloco.engine.diloco import first_syncs

    schedule = PacedSchedule(h=200, total_steps=8000, gamma=0.5)
    due, syncs = first_syncs(2, schedule.period(0, 1.0)), [[], []]
    for step in range(1, 8001):  # what the engine does: each fragment's next sync is its round's period away
        for p in (0, 1):
            if step >= due[p]:
                syncs[p].append(step)
                due[p] = step + schedule.period(step, 1.0) if step < 8000 else 10**9
    assert syncs[1] == list(schedule.points)  # the last fragment runs the plan
    assert len(syncs[0]) == 41 and syncs[0][-1] == 8000  # as under fixed H: one early half-round, one capped
    # fragment 0 syncs halfway between fragment 1's, by the period it is in, to the end
    assert all(a < b < c for a, b, c in zip(syncs[1], syncs[0][1:], syncs[1][1:]))
