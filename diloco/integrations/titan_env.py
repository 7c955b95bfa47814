"""Importing torchtitan for the integration: the install hint, and the CPU device it cannot pick itself.

torchtitan 0.3.0 chooses its device once, at import: ``torchtitan/tools/utils.py:55``,
``device_type = _get_available_device_type() or "cuda"``. On a machine without an accelerator that is
``"cuda"``, and ``Trainer.__init__`` then fails at ``device_module.set_device(self.device)``
(``trainer.py:301``: ``torch.cuda`` without CUDA). ``load()`` imports torchtitan and, only where torch
sees no accelerator, sets that choice to ``"cpu"`` in every module that copied it at import
(``DEVICE_MODULES``); the in-group backend then is Gloo (torch's default for ``cpu``). Its device module
is ``CpuDevice``, not ``torch.cpu``: torchtitan's memory monitor asks it for a name, properties and
memory statistics (``components/metrics.py:42``, ``torch.cpu`` has no ``get_device_name``), which on a CPU
are the host's name and memory and no statistics (the logged peaks read -1). On a GPU machine nothing
is changed.

torchtitan 0.3.0 was written against a newer torch than 2.13: after the first step its ``Trainer.train``
calls ``dist_utils.set_pg_timeouts``, which calls ``torch.distributed.set_timeout``
(``torchtitan/distributed/utils.py:595``; torch 2.13 has none: ``AttributeError: module
'torch.distributed' has no attribute 'set_timeout'``). Where torch lacks it, ``load()`` puts
``set_pg_timeouts`` below in its place: the same barrier, then torch 2.13's
``distributed_c10d._set_pg_timeout`` on the same groups. Each module named must exist and hold the names, or ``load()`` fails: a
torchtitan that moved them is an error here, not a silent CUDA default later.
"""

from __future__ import annotations

import importlib
import os
import platform
from types import ModuleType, SimpleNamespace
from typing import Any


INSTALL_HINT = 'pip install -e ".[titan]"'
# the torchtitan modules that copy ``device_type`` / ``device_module`` from tools.utils at import (0.3.0)
DEVICE_MODULES = ("torchtitan.tools.utils", "torchtitan.distributed.utils", "torchtitan.distributed.parallel_dims",
                  "torchtitan.components.metrics", "torchtitan.models.common.token_dispatcher",
                  "torchtitan.tools.profiler")
_loaded: dict[str, str] = {}


class CpuDevice:
    """What torchtitan asks of a device module (``torch.cuda``'s names), for the host CPU."""

    @staticmethod
    def set_device(device: object) -> None:
        """Nothing to select on a CPU."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device: object = None) -> SimpleNamespace:
        """The host's name and physical memory (``total_memory``, bytes)."""
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        return SimpleNamespace(name=CpuDevice.get_device_name(), total_memory=memory or 1)

    @staticmethod
    def memory_stats(device: object = None) -> dict[str, int]:
        return {}  # no allocator statistics on a CPU: torchtitan logs its peaks as -1

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: object = None) -> None:
        pass


def has_accelerator() -> bool:
    """Whether torch sees an accelerator (what torchtitan's own device choice asks)."""
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None


def load() -> ModuleType:
    """``import torchtitan`` (ModuleNotFoundError naming the extra without it); on a machine without an
    accelerator, torchtitan's device set to ``cpu``. Idempotent."""
    try:
        import torchtitan
        import torchtitan.trainer  # noqa: F401  (its dependencies: tyro, spmd_types, torchdata, ...)
    except ImportError as e:
        raise ModuleNotFoundError(f"the torchtitan integration needs torchtitan and its dependencies ({e}): "
                                  f"{INSTALL_HINT}", name=e.name) from e
    if not _loaded:
        import torch.distributed

        if not hasattr(torch.distributed, "set_timeout"):
            dist_utils = importlib.import_module("torchtitan.distributed.utils")
            if not hasattr(dist_utils, "set_pg_timeouts"):
                raise RuntimeError("torchtitan.distributed.utils has no set_pg_timeouts: not torchtitan 0.3.0")
            dist_utils.set_pg_timeouts = set_pg_timeouts
        _loaded["device_type"] = "cpu" if not has_accelerator() else importlib.import_module(
            "torchtitan.tools.utils").device_type
        if _loaded["device_type"] == "cpu":
            for name in DEVICE_MODULES:
                module = importlib.import_module(name)
                for attr, value in (("device_type", "cpu"), ("device_module", CpuDevice)):
                    if attr in vars(module):
                        setattr(module, attr, value)
                if "device_type" not in vars(module) and "device_module" not in vars(module):
                    raise RuntimeError(f"{name} holds neither device_type nor device_module: this torchtitan "
                                       f"({getattr(torchtitan, '__version__', '?')}) is not the one the CPU "
                                       "device fix was written for (0.3.0)")
    return torchtitan


def set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
    """torchtitan's ``set_pg_timeouts`` for a torch without ``torch.distributed.set_timeout`` (2.13):
    every rank reaches the barrier first, then each 1-D mesh's group and the default group take
    ``timeout``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        _set_pg_timeout(timeout, group)


def device_type() -> str:
    """The device type torchtitan trains on in this process (after ``load()``)."""
    load()
    return _loaded["device_type"]
