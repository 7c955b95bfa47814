"""Sharding a model inside a group with FSDP2 (``torch.distributed.fsdp.fully_shard``).

``shard_model(model, units=...)`` wraps each *unit* (a module whose parameters are gathered
together for its forward and backward) with ``fully_shard``, then the root, over a 1-D device
mesh of the group's ranks. Every trainable parameter then is a DTensor sharded on dim 0, which is
what ``diloco.DiLoCo`` exchanges shard by shard. Units:

* ``None`` or ``True`` (the default): the items of every ``nn.ModuleList`` in the model (a
  transformer's blocks), or nothing but the root if it has none;
* a module, or its dotted name: a ``ModuleList``/``Sequential`` stands for each of its items
  (``"blocks"`` or ``model.blocks``), any other module for itself;
* a list of modules or dotted names (``["blocks.0", "blocks.1"]``);
* a module class (every instance is a unit), or a predicate ``f(name, module) -> bool``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch.nn as nn

Units = Union[None, bool, str, nn.Module, Sequence[Union[str, nn.Module]], type, Callable[[str, nn.Module], bool]]


class ShardingConfigError(ValueError):
    """A sharding request names modules the model does not have, or cannot be applied."""


def units_of(model: nn.Module, units: Units = None) -> list[nn.Module]:
    """The modules ``units`` picks in ``model`` (see the module doc), in ``named_modules`` order,
    the root left out; ShardingConfigError when a name matches nothing."""
    named = dict(model.named_modules())
    top = ", ".join(dict(model.named_children())) or "none"
    if units is None or units is True:
        return [m for name, lst in named.items() if isinstance(lst, nn.ModuleList) for m in lst]
    if isinstance(units, str):
        if units not in named or not units:
            raise ShardingConfigError(f"no module {units!r} in the model; its top-level modules: {top}")
        units = named[units]
    if isinstance(units, nn.Module):
        picked = list(units) if isinstance(units, (nn.ModuleList, nn.Sequential)) else [units]
    elif isinstance(units, type):
        picked = [m for name, m in named.items() if name and isinstance(m, units)]
    elif callable(units):
        picked = [m for name, m in named.items() if name and units(name, m)]
    else:
        missing = [u for u in units if isinstance(u, str) and (u not in named or not u)]
        if missing:
            raise ShardingConfigError(f"no module(s) {missing} in the model; its top-level modules: {top}")
        picked = [named[u] if isinstance(u, str) else u for u in units]
    inside = {id(m) for m in named.values()}
    if any(id(m) not in inside or m is model for m in picked):
        raise ShardingConfigError("a unit to shard is the model itself or not one of its submodules")
    return picked


def shard_model(model: nn.Module, units: Units = None, *, mesh: Any = None, **fsdp_kwargs: Any) -> nn.Module:
    """``fully_shard`` each unit, then ``model`` itself, over ``mesh`` (default: a 1-D CPU or CUDA
    mesh over the whole ``torch.distributed`` world, which must be initialized). ``fsdp_kwargs``
    go to every ``fully_shard`` call (``reshard_after_forward``, ``mp_policy`` ...). Returns
    ``model`` (sharded in place)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        if not dist.is_initialized():
            raise ShardingConfigError("sharding needs torch.distributed initialized (run under torchrun)")
        device = next(model.parameters()).device.type if any(True for _ in model.parameters()) else "cpu"
        mesh = init_device_mesh("cuda" if device == "cuda" and torch.cuda.is_available() else "cpu",
                                (dist.get_world_size(),))
    if getattr(mesh, "ndim", 1) != 1:
        raise ShardingConfigError("diloco exchanges dim-0 shards over a 1-D mesh; HSDP (2-D meshes) is not supported")
    for unit in units_of(model, units):
        fully_shard(unit, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model
