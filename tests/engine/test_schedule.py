import math

import pytest

from diloco.engine.schedule import (
    FixedSchedule,
    QSRSchedule,
    fixed_period,
    inner_lr,
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
