"""The schedule and outer-rule specs: registries by name, what each builds, their checks, torch-free."""

import subprocess
import sys
from pathlib import Path

import pytest

import diloco
from diloco.engine.outer_spec import OUTER_RULES, OuterSpec, outer_rule_names
from diloco.engine.schedule import FixedSchedule, PacedSchedule, QSRSchedule, TimeRounds
from diloco.engine.schedule_spec import SCHEDULES, ScheduleSpec, schedule_names


def test_each_schedule_builds_what_its_name_says():
    assert schedule_names() == ("fixed", "qsr", "paced") == tuple(SCHEDULES)
    assert ScheduleSpec(h=30, total_steps=300).build() == FixedSchedule(30, total_steps=300, h_max=None)
    assert ScheduleSpec(h=30, total_steps=300, h_max=60).build() == FixedSchedule(30, total_steps=300, h_max=60)
    qsr = ScheduleSpec(name="qsr", h=4, total_steps=300, peak_lr=0.008, warmup_steps=20).build()
    assert qsr == QSRSchedule(h_base=4, alpha=pytest.approx(0.016), gamma=2.0, warmup_steps=20, total_steps=300)
    paced = ScheduleSpec(name="paced", h=30, total_steps=300, paced_gamma=0.5).build()
    assert paced == PacedSchedule(30, 300, gamma=0.5, lr_schedule="cosine", min_ratio=0.1)
    assert ScheduleSpec(name="qsr", h=30, total_steps=300, round_seconds=2.0).build() == TimeRounds(2.0, 10)


def test_a_schedule_spec_names_what_is_wrong():
    assert ScheduleSpec(name="paced", h=30, h_max=60, paced_gamma=5.0).problems() == [
        "--h-max bounds the fixed and QSR schedules, not 'paced' (its longest period is set by --h and --paced-gamma)"
        "\n  --paced-gamma must be in [-4, 4], got 5.0"]
    assert ScheduleSpec(h=30, h_max=10, qsr_gamma=0).problems() == [
        "--qsr-gamma must be > 0, got 0", "--h-max must be 0 or >= --h (30), got 10"]
    assert ScheduleSpec(h=None, h_max=10).problems() == []  # --h auto: H's checks wait for the decided H
    with pytest.raises(ValueError, match="unknown schedule 'fast'; choose fixed, qsr, paced"):
        ScheduleSpec(name="fast").build()
    with pytest.raises(ValueError, match="--h auto decides it"):
        ScheduleSpec(h=None).build()


def test_each_outer_rule_builds_with_the_modes_defaults():
    assert outer_rule_names() == ("nesterov", "sgd", "adam", "sparseloco") == tuple(OUTER_RULES)
    spec = OuterSpec()
    assert [(spec.lr_for(m), spec.momentum_for(m), spec.alpha_for(m)) for m in ("blocking", "overlap", "eager",
                                                                                  "delayed")] == \
        [(0.7, 0.9, 0.0), (0.7, 0.9, 0.5), (0.7, 0.5, 0.0), (0.7, 0.0, 0.0)]
    assert (OuterSpec(optimizer="sparseloco").lr_for("blocking"), OuterSpec(lr=0.5).lr_for("eager")) == (1.0, 0.5)
    assert OuterSpec(optimizer="sparseloco", sparseloco_beta=0.9).build("blocking").error_decay == 0.9
    for name in OUTER_RULES:
        assert callable(OuterSpec(optimizer=name).build("blocking") if name != "sparseloco" else OuterSpec().build("co2"))
    with pytest.raises(ValueError, match="unknown outer optimizer 'lion'; choose nesterov, sgd, adam, sparseloco"):
        OuterSpec(optimizer="lion").build("blocking")


def test_an_outer_spec_names_what_is_wrong():
    assert OuterSpec(optimizer="sparseloco", momentum=0.5, residual_decay=0.5).problems("eager") == [
        "--residual-decay with --outer-optimizer sparseloco: its residual's decay is --sparseloco-beta",
        "--outer-optimizer sparseloco takes no --outer-momentum (its residual stands in for it), got 0.5",
        "--outer-optimizer sparseloco runs with --mode blocking, overlap or delayed, not eager"]
    assert OuterSpec(lr=0.0, co2_penalty="0.5").problems("co2") == [
        "--outer-lr must be > 0 (or -1 for the mode's default), got 0.0",
        "--co2-penalty must be 'adaptive' or a number >= 1, got '0.5'"]


def test_the_specs_read_without_torch():
    program = (f"import sys, types\npkg = types.ModuleType('diloco')\npkg.__path__ = [{str(Path(diloco.__file__).parent)!r}]\n"
               "sys.modules['diloco'] = pkg\nfrom diloco.engine.outer_spec import OuterSpec\n"
               "from diloco.engine.schedule_spec import ScheduleSpec\n"
               "assert not OuterSpec().problems('blocking') and not ScheduleSpec(name='paced').problems()\n"
               "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
