"""Scaffolding of the update-rule tests (eager, delayed, CO2): one scalar parameter per group,
inner SGD with lr 1 on scripted gradients, so every sync is computable by hand."""

from __future__ import annotations

import torch
import torch.nn as nn
from diloco_helpers import build_in_threads, run_in_threads

from diloco.engine.averaging import InProcessGroups
from diloco.engine.diloco import DiLoCo


class Scalar(nn.Module):
    """One parameter w = 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))


def run_scalar_groups(mode, grads, outer_optimizer, h=2, **kw):
    """Group g takes inner steps with gradients ``grads[g]`` (H per round). Returns, per group,
    w_global after every sync and after close(), and the engines. Checks that the local model
    restarts at the global one after each sync (merge α = 0)."""
    n = len(grads)
    groups = InProcessGroups(n)
    models = [Scalar() for _ in range(n)]

    def make(i):
        inner = torch.optim.SGD(models[i].parameters(), lr=1.0)
        return DiLoCo(models[i], inner, averager=groups.member(i), sync_every=h, mode=mode,
                      outer_optimizer=outer_optimizer, **kw)

    engines = build_in_threads(make, n)
    trace: list[list[float]] = [[] for _ in range(n)]

    def work(i):
        e = engines[i]
        for g in grads[i]:
            e.model.w.grad = torch.tensor([float(g)])
            e.inner_optimizer.step()
            if e.step():
                trace[i].append(float(e.global_params[0]))
                assert torch.equal(e.model.w.detach(), e.global_params[0])  # α = 0: local restarts at global
        e.close()
        trace[i].append(float(e.global_params[0]))

    run_in_threads(work, n)
    return trace, engines
