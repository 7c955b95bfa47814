"""How many torch CPU threads a rank computes on: what ``--threads-per-rank`` says, or its share of
the CPU its container was given.

``--threads-per-rank 0`` (the default) takes, in order: ``$DILOCO_CPU_REQUEST``, whole cores (the
Kubernetes manifests set it from the container's CPU request through the downward API), shared by
the ranks torchrun started on this node (``$LOCAL_WORLD_SIZE``); else the cgroup's CPU quota (a
container's CPU limit) shared the same way; else 1. ``OMP_NUM_THREADS`` does not decide it: torch
sets its thread count from this at start.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

CPU_REQUEST_ENV = "DILOCO_CPU_REQUEST"


def cgroup_cpu_quota(root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``), or None when there is none or it cannot be read."""
    root = Path(root)
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for folder in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((root / folder / "cpu.cfs_quota_us").read_text())
            period = int((root / folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else quota / period
    return None


def threads_per_rank(configured: int, env: Mapping[str, str], *,
                     cgroup_root: str | Path = "/sys/fs/cgroup") -> tuple[int, str]:
    """``(threads, where the number comes from)`` for one rank (see the module doc). ValueError
    for a ``$DILOCO_CPU_REQUEST`` or ``$LOCAL_WORLD_SIZE`` that is not a whole number >= 1."""
    if configured < 0:
        raise ValueError(f"--threads-per-rank must be >= 0, got {configured}")
    if configured:
        return configured, "--threads-per-rank"
    local = _whole(env.get("LOCAL_WORLD_SIZE", "1"), "LOCAL_WORLD_SIZE")
    if CPU_REQUEST_ENV in env:
        cores = _whole(env[CPU_REQUEST_ENV], CPU_REQUEST_ENV)
        return max(1, cores // local), f"${CPU_REQUEST_ENV}={cores} cores shared by {local} rank(s)"
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        return max(1, math.floor(quota) // local), f"the cgroup's CPU quota of {quota:g} cores shared by {local} rank(s)"
    return 1, "neither a CPU request nor a CPU quota is known"


def _whole(text: str, name: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"${name}={text!r}: want a whole number >= 1")
    return value
