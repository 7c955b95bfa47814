"""--schedule paced (issue 31): validation, the schedule it makes, the flag in the help."""

import pytest

from diloco.cli import build_parser
from diloco.engine.schedule import PacedSchedule, paced_sync_steps
from diloco.job.config import Config, ConfigError
from diloco.runtime.rank.worker import make_schedule


def _cfg(steps: int = 8000, **sync) -> Config:
    cfg = Config()
    cfg.train.steps = steps
    cfg.sync.schedule = "paced"
    for k, v in sync.items():
        setattr(cfg.sync, k, v)
    return cfg


def test_paced_makes_the_planned_schedule_of_the_runs_lr_decay():
    cfg = _cfg(h=200, paced_gamma=0.5)
    cfg.inner.min_lr_ratio = 0.2
    sched = make_schedule(cfg.validate())
    assert sched == PacedSchedule(200, 8000, gamma=0.5, lr_schedule="cosine", min_ratio=0.2)
    assert sched.points == paced_sync_steps(8000, 40, 0.5, "cosine", 0.2)
    assert sched.points != paced_sync_steps(8000, 40, 0.5, "cosine", 0.1)  # the run's floor, not the default


@pytest.mark.parametrize("sync, message", [
    ({"h": 200, "h_max": 300}, "--h-max bounds the fixed and QSR schedules, not 'paced'"),
    ({"h": 200, "paced_gamma": 9.0}, r"--paced-gamma must be in \[-4, 4\]"),
    ({"h": 200, "paced_gamma": float("nan")}, "--paced-gamma: must be finite"),
    # the plan's first period is 141 steps: overlap's tau must land inside it, not inside H=200
    ({"h": 200, "mode": "overlap", "overlap_steps": 150}, r"must be < the shortest paced period / P \(141\)"),
    ({"h": 200, "round_seconds": 2.0}, "--schedule fixed"),
])
def test_bad_paced_settings_are_refused_with_a_reason(sync, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**sync).validate()


def test_overlap_inside_the_shortest_paced_period_is_accepted():
    _cfg(h=200, mode="overlap", overlap_steps=140).validate()


def test_the_flags_are_in_the_help():
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    text = " ".join(run.format_help().split())
    assert "--paced-gamma" in text and "{fixed,qsr,paced}" in text
