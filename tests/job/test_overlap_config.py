"""--mode overlap: the config refuses what the engine would refuse at its start (tau must land
before the next fragment is due in the first round, which --steps caps), so a setting
``--codec auto`` keeps (``runnable_table``) is one the engine runs."""

import itertools

import pytest

from diloco.engine.diloco import first_syncs
from diloco.engine.schedule import fixed_period
from diloco.job import auto_choice as ac
from diloco.job.config import Config, ConfigError


def _overlap(h: int, steps: int, fragments: int, tau: int) -> Config:
    cfg = Config()
    cfg.train.steps, cfg.model.n_layer = steps, 4
    s = cfg.sync
    s.mode, s.h, s.fragments, s.overlap_steps = "overlap", h, fragments, tau
    return cfg


@pytest.mark.parametrize("h, steps, fragments, tau", [
    (h, steps, p, tau) for h, steps, p, tau in itertools.product((10, 30), (4, 10, 12, 100), (1, 2, 3), (1, 4, 5, 9))
    if min(h, steps) >= p])
def test_the_config_accepts_exactly_what_the_engine_starts(h, steps, fragments, tau):
    first = fixed_period(0, h=h, total_steps=steps)
    engine_ok = tau < min(first_syncs(fragments, first))
    try:
        _overlap(h, steps, fragments, tau).validate()
        config_ok = True
    except ConfigError:
        config_ok = False
    assert config_ok == engine_ok


def test_the_reason_names_the_cap():
    with pytest.raises(ConfigError, match=r"--overlap-steps \(5\) must be < H/P \(5\), with H capped at 10"):
        _overlap(30, 10, 2, 5).validate()


def test_auto_leaves_out_an_overlapped_setting_a_short_run_cannot_start():
    from diloco.runtime.rank.auto_setting import runnable_table

    cfg = Config()
    cfg.train.steps, cfg.transport.codec, cfg.sync.h = 10, "auto", ac.AUTO_H
    rows = {e.row for e in runnable_table(cfg, ac.load_table()).entries}
    assert "slo-overlap-p2-tau5" not in rows and "m2-h30-outer" in rows
    cfg.train.steps = 300
    assert "slo-overlap-p2-tau5" in {e.row for e in runnable_table(cfg, ac.load_table()).entries}
