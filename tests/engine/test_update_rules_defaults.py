"""Each sync mode's default outer step (diloco.engine.outer.MODE_DEFAULTS / CO2_DEFAULTS): the engine's
default when no outer optimizer is given, and what --outer-lr/--outer-momentum -1 resolve to.
Why these values (stale outer gradients overshoot under momentum 0.9): diloco/engine/outer.py's doc."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from diloco.engine.averaging import SingleGroup
from diloco.engine.diloco import DiLoCo
from diloco.engine.outer import (
    MODE_DEFAULTS,
    CO2Outer,
    by_mode,
    mode_lr,
    mode_momentum,
    nesterov,
)
from diloco.job.config import Config, ConfigError


def test_mode_defaults():
    assert MODE_DEFAULTS["blocking"] == MODE_DEFAULTS["overlap"] == (0.7, 0.9)  # DiLoCo's
    assert MODE_DEFAULTS["eager"] == (0.7, 0.5)
    assert MODE_DEFAULTS["delayed"] == (0.7, 0.0)
    assert (mode_lr("co2"), mode_momentum("co2")) == (1.0, 0.0)  # CO2's authors, <= 16 workers
    with pytest.raises(ValueError, match="no outer-optimizer default"):
        by_mode("dp")


@pytest.mark.parametrize("mode", ["blocking", "overlap", "eager", "delayed", "co2"])
def test_engine_takes_the_modes_outer_optimizer_by_default(mode):
    m = nn.Linear(2, 1)
    e = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), averager=SingleGroup(), sync_every=4, mode=mode)
    opt = e.fragments[0].optimizer
    if mode == "co2":
        assert isinstance(opt, CO2Outer)
        assert (opt.defaults["lr"], opt.defaults["momentum"], opt.defaults["clip"]) == (1.0, 0.0, 1.0)
        return
    lr, mu = MODE_DEFAULTS[mode]
    assert isinstance(opt, torch.optim.SGD)
    assert (opt.defaults["lr"], opt.defaults["momentum"], opt.defaults["nesterov"]) == (lr, mu, mu > 0)


def test_nesterov_with_zero_momentum_is_plain_sgd():
    p = torch.zeros(2, requires_grad=True)
    opt = nesterov(0.5, 0.0)([p])  # torch itself refuses nesterov=True without momentum
    p.grad = torch.tensor([1.0, -2.0])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([-0.5, 1.0]))


def test_config_resolves_the_modes_defaults_and_keeps_explicit_values():
    cfg = Config().validate()
    assert (cfg.outer.lr, cfg.outer.momentum) == (-1.0, -1.0)
    assert [(cfg.outer.outer_lr(m), cfg.outer.outer_momentum(m)) for m in ("blocking", "eager", "delayed")] == [
        (0.7, 0.9), (0.7, 0.5), (0.7, 0.0)]
    cfg.outer.lr, cfg.outer.momentum = 0.4, 0.8
    cfg.validate()
    assert (cfg.outer.outer_lr("eager"), cfg.outer.outer_momentum("delayed")) == (0.4, 0.8)
    cfg.outer.momentum = 0.0
    assert cfg.validate().outer.outer_momentum("blocking") == 0.0
    for bad in ({"lr": 0.0}, {"lr": -0.5}, {"momentum": 1.0}, {"momentum": -0.5}):
        c = Config()
        for k, v in bad.items():
            setattr(c.outer, k, v)
        with pytest.raises(ConfigError, match="--outer-"):
            c.validate()
