"""A sharded (FSDP2) model's and inner optimizer's state as this rank's plain tensors, and back.

A job checkpoint is one ``torch.save`` file per rank, read with ``torch.load(weights_only=True)``,
which does not rebuild DTensors. So a rank saves the local part of every DTensor (``localize``)
and, on resume, puts each part back into the live DTensor it came from (``load_model_state``,
``load_optimizer_state``). That needs the same number of ranks per group as when it was saved
(a different one is refused with ``ShardMismatch``); ``diloco.runtime.checkpoints.dcp_checkpoint`` writes
checkpoints that reshard. Plain (unsharded) tensors pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class ShardMismatch(ValueError):
    """A saved shard does not fit this rank's part of the parameter (another number of ranks)."""


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def localize(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its local tensor (dicts, lists and tuples walked)."""
    if _is_dtensor(obj):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: localize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(localize(v) for v in obj)
    return obj


def _refuse(what: str, saved: torch.Tensor, here: torch.Tensor) -> ShardMismatch:
    return ShardMismatch(f"{what}: the checkpoint holds a shard of shape {tuple(saved.shape)}, this rank's is "
                         f"{tuple(here.shape)}: it was written with another number of ranks per group. Resume with "
                         "the same number, or save and load with diloco.runtime.checkpoints.dcp_checkpoint, "
                         "which reshards")


@torch.no_grad()
def load_model_state(model: nn.Module, saved: dict[str, Any]) -> None:
    """Load ``localize(model.state_dict())`` as saved: DTensor entries by copying into this rank's
    part, the rest with ``load_state_dict``. ShardMismatch when a shard's shape differs. An
    unsharded model: ``model.load_state_dict(saved)`` (strict), as ever."""
    if not any(_is_dtensor(t) for t in model.state_dict().values()):
        model.load_state_dict(saved)
        return
    plain = {}
    for name, here in model.state_dict().items():
        if name not in saved:
            raise KeyError(f"the checkpoint lacks {name!r}")
        if _is_dtensor(here):
            local = here.to_local()
            if tuple(saved[name].shape) != tuple(local.shape):
                raise _refuse(name, saved[name], local)
            local.copy_(saved[name])
        else:
            plain[name] = saved[name]
    if plain:  # buffers and any parameter left unsharded
        model.load_state_dict(plain, strict=False)


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load ``localize(optimizer.state_dict())`` as saved: each per-parameter tensor shaped like
    its parameter's local part becomes a DTensor laid out like the parameter again."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(_is_dtensor(p) for p in params):  # unsharded: as ever
        optimizer.load_state_dict(saved)
        return
    state = {}
    for index, per_param in saved["state"].items():
        p = params[int(index)]
        if not _is_dtensor(p):
            state[index] = per_param
            continue
        local = p.to_local()
        rebuilt = {}
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if tuple(v.shape) != tuple(local.shape):
                    raise _refuse(f"inner optimizer state {k!r} of parameter {index}", v, local)
                v = DTensor.from_local(v.to(local.device), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
            rebuilt[k] = v
        state[index] = rebuilt
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
