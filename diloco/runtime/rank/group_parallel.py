"""How a worker runs its model inside the group: replicated (DDP) or sharded (FSDP2).

``--parallel ddp`` wraps the model in ``DistributedDataParallel``; ``fsdp`` shards it with
``diloco.shard_model`` (the units the task names in ``Task.shard``, else each block of every
``nn.ModuleList``); ``auto`` (the default) shards exactly when the task asks for it. The worker
then treats both alike, except where every rank of a sharded group must take part: a forward
pass (evaluation) and gathering the global model to save it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from diloco.job.config import ConfigError
from diloco.job.fsdp import shard_model
from diloco.job.task import Task


def wants_sharding(parallel: str, task: Task) -> bool:
    """Whether a job of ``--parallel parallel`` shards the task's model inside each group."""
    return parallel == "fsdp" or (parallel == "auto" and task.shard is not None)


def wrap(task: Task, model: nn.Module, device: torch.device, *, parallel: str, mode: str) -> nn.Module:
    """The model as the inner steps run it under ``--parallel parallel --mode mode``: DDP around
    it, or the model itself sharded in place."""
    if not wants_sharding(parallel, task):
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "dp":
        raise ConfigError("the task asks for sharding (Task.shard), which --mode dp cannot average: pass "
                          "--parallel ddp or another --mode")
    return shard_model(model, None if task.shard is True else task.shard)


def bare(net: nn.Module) -> nn.Module:
    """The model inside ``wrap``'s result (for DDP its ``module``)."""
    return net.module if isinstance(net, DistributedDataParallel) else net


def is_sharded(net: nn.Module) -> bool:
    """Whether ``wrap`` sharded the model (every rank then takes part in each forward)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in bare(net).parameters())


def evaluate_on(rank: int, net: nn.Module, evaluate: Callable[[], float]) -> float:
    """``evaluate()`` as rank 0 reports it: run on rank 0 only, or on every rank of a sharded
    group (its forward passes are collectives), NaN on the other ranks."""
    if rank != 0 and not is_sharded(net):
        return math.nan
    value = evaluate()
    return value if rank == 0 else math.nan


def global_model_to_save(engine: Any, net: nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """The whole global model by name on rank 0 (None elsewhere). Sharded: every rank of the group
    calls it and takes part in gathering each parameter (each is whole on every rank for a moment)."""
    if not is_sharded(net):
        return engine.global_state_dict() if rank == 0 else None
    whole = {}
    for name, t in engine.global_state_dict().items():
        full = t.full_tensor()
        if rank == 0:
            whole[name] = full
    return whole if rank == 0 else None
