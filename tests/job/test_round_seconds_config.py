"""--round-seconds (issue 32, point 1): validation, the schedule it makes, the flag in the help."""

import pytest

from diloco.cli import build_parser
from diloco.engine.schedule import FixedSchedule, TimeRounds
from diloco.job.config import Config, ConfigError
from diloco.runtime.rank.worker import make_schedule


def _cfg(**sync) -> Config:
    cfg = Config()
    for k, v in sync.items():
        setattr(cfg.sync, k, v)
    return cfg


def test_round_seconds_makes_time_rounds_as_many_as_fixed_h_would_run():
    cfg = _cfg(round_seconds=2.5, h=30)
    cfg.train.steps = 100
    sched = make_schedule(cfg.validate())
    assert sched == TimeRounds(2.5, 4)  # ceil(100 / 30)
    assert isinstance(make_schedule(Config().validate()), FixedSchedule)  # the default stays fixed H


@pytest.mark.parametrize("sync, train, message", [
    ({"round_seconds": -1.0}, {}, "--round-seconds must be >= 0"),
    ({"round_seconds": 2.0, "mode": "eager"}, {}, "--round-seconds runs with --mode blocking or overlap"),
    ({"round_seconds": 2.0, "mode": "delayed"}, {}, "not --mode delayed"),
    ({"round_seconds": 2.0, "schedule": "qsr"}, {}, "--schedule fixed"),
    ({"round_seconds": 2.0}, {"checkpoint_every": 10, "checkpoint_dir": "/tmp/x"}, "does not take --checkpoint-every"),
    ({"round_seconds": float("inf")}, {}, "must be finite"),
])
def test_bad_round_seconds_settings_are_refused_with_a_reason(sync, train, message):
    cfg = _cfg(**sync)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_round_seconds_take_overlap_and_streaming_fragments():
    cfg = _cfg(round_seconds=2.0, mode="overlap", fragments=2, overlap_steps=1, h=30)
    cfg.model.n_layer = 2
    assert cfg.validate().sync.fragments == 2


def test_the_flag_is_in_the_help():
    parser = build_parser()
    run = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    text = " ".join(run.format_help().split())
    assert "--round-seconds" in text and "rounds by time" in text
