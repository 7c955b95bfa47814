"""A model of your own through ``diloco run --entry``: an MLP learns a noisy teacher function.

    diloco run --entry examples.regression:make_task --steps 200 --h 20 --groups 2 --ranks-per-group 1

(run from the repository root, or put this folder's parent on PYTHONPATH). Each group draws its
own inputs (a shard of the same distribution); targets come from a fixed random "teacher"
network plus noise, so the loss has a known floor (the noise variance, 0.01). ``--entry-args``
sets ``width`` (hidden units, default 128) and ``dim`` (inputs, default 16).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

import diloco

NOISE_STD = 0.1


class MLP(nn.Module):
    """Inputs ``dim`` -> two hidden layers of ``width`` (GELU) -> one output."""

    def __init__(self, dim: int = 16, width: int = 128) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, width)
        self.hidden = nn.Sequential(nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(self.inp(x))).squeeze(-1)


def teacher(dim: int) -> nn.Module:
    """The function to learn: a fixed random network (the same in every group and process)."""
    g = torch.Generator().manual_seed(12345)
    net = nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():  # unit-variance pre-activations and outputs of order 1
        for p in net.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
    return net


@torch.no_grad()
def batches(dim: int, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (x, y) batches: x ~ N(0, I), y = teacher(x) + noise."""
    f = teacher(dim)
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch_size, dim, generator=g)
        yield x, f(x).squeeze(-1) + NOISE_STD * torch.randn(batch_size, generator=g)


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def make_task(ctx: diloco.TaskContext) -> diloco.Task:
    """The entry point ``diloco worker`` calls in every rank of every group."""
    dim, width = int(ctx.args.get("dim", 16)), int(ctx.args.get("width", 128))
    torch.manual_seed(ctx.seed)  # the same initial weights in every group
    model = MLP(dim, width)
    held_out = batches(dim, 256, seed=999_999)  # the same held-out set everywhere
    return diloco.Task(
        model=model,
        train_batches=batches(dim, ctx.batch_size, seed=1000 * ctx.group + ctx.rank),
        loss=mse,
        eval_batches=[next(held_out) for _ in range(4)],
    )
