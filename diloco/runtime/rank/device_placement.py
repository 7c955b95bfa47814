"""Which GPU each rank of each group uses on one host. Pure functions: no torch, no CUDA calls.

``place_ranks`` is what ``diloco run`` asks before it starts a process: every group on this host,
no two ranks of one group on one GPU (NCCL refuses that), the groups spread over the GPUs before
any GPU is shared (ranks of different groups may share one: they are different communicators).
Each group's torchrun gets its list in ``DILOCO_DEVICE_MAP`` (local rank i uses its i-th entry).

Under ``torchrun`` by hand, ``LOCAL_RANK`` keeps its meaning: local rank i uses GPU
i + ``DILOCO_GPU_OFFSET`` (default 0), so several groups share one host by giving each its own
offset (e.g. 0 and 4 for two groups of 4 ranks on 8 GPUs). ``rank_cuda_index`` is that rule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

DEVICE_MAP_ENV = "DILOCO_DEVICE_MAP"
GPU_OFFSET_ENV = "DILOCO_GPU_OFFSET"
MAX_GROUPS_LISTED = 8  # describe() lists each group's GPUs up to this many groups


class PlacementError(ValueError):
    """The ranks cannot be placed on this host's GPUs; the message names the numbers and a way out."""


@dataclass(frozen=True)
class DevicePlan:
    """Where every rank runs: ``devices[g][r]`` is the CUDA index of rank r of group g, or None
    for the CPU (backend gloo). ``requested``: the ranks per group asked for, before any fitting."""

    gpus: int
    devices: tuple[tuple[int | None, ...], ...]
    requested: tuple[int, ...]

    @property
    def sizes(self) -> list[int]:
        """Ranks of every group as placed (fewer than ``requested`` where they were fitted)."""
        return [len(d) for d in self.devices]

    @property
    def on_gpu(self) -> bool:
        return any(i is not None for d in self.devices for i in d)

    @property
    def reduced(self) -> bool:
        """True when some group gets fewer ranks than were asked for."""
        return tuple(self.sizes) != self.requested

    def device_map(self, group: int) -> str | None:
        """The ``DILOCO_DEVICE_MAP`` value of one group ("0,1": local rank i uses the i-th), None on CPU."""
        if not self.on_gpu:
            return None
        return ",".join(str(i) for i in self.devices[group])

    def describe(self) -> str:
        """One line for people, e.g. "2 groups × 1 rank on 1 GPU (ranks per group reduced from 2: ...)"."""
        what = _groups_text(self.sizes)
        if not self.on_gpu:
            return f"{what} on CPU (backend gloo)"
        load = Counter(i for d in self.devices for i in d)
        text = f"{what} on {_plural(self.gpus, 'GPU')}"
        if max(load.values()) > 1:
            text += f", up to {_plural(max(load.values()), 'rank')} (of different groups) per GPU"
        if len(self.devices) <= MAX_GROUPS_LISTED and self.gpus > 1:  # on one GPU there is nothing to list
            text += ": " + "; ".join(f"group {g} → cuda {self.device_map(g)}" for g in range(len(self.devices)))
        if self.reduced:
            before = sorted(set(self.requested))
            text += (f" (ranks per group reduced from {', '.join(map(str, before))}: "
                     f"the host has {_plural(self.gpus, 'GPU')})")
        return text


def place_ranks(gpus: int, group_sizes: Sequence[int], *, backend: str = "nccl", fit: bool = False) -> DevicePlan:
    """Place ``group_sizes[g]`` ranks of every group g on a host with ``gpus`` visible GPUs.

    ``backend``: the resolved in-group backend, ``"nccl"`` (one GPU per rank) or ``"gloo"`` (every
    rank on the CPU; ``gpus`` is ignored). Ranks are numbered across groups in order and rank k
    takes GPU ``k mod gpus``: one group's ranks are on distinct GPUs, no GPU is used twice while
    there are GPUs left, and the ranks per GPU differ by at most one. A group with more ranks than
    GPUs is cut to ``gpus`` ranks when ``fit`` (the ranks per group were a default), else it is a
    PlacementError, as is nccl with no GPU.
    """
    sizes = [int(n) for n in group_sizes]
    if not sizes or any(n < 1 for n in sizes):
        raise PlacementError(f"every group needs at least one rank, got group sizes {sizes}")
    if backend == "gloo":
        return DevicePlan(max(gpus, 0), tuple((None,) * n for n in sizes), tuple(sizes))
    if backend != "nccl":
        raise PlacementError(f"backend must be resolved to nccl or gloo before placement, got {backend!r}")
    if gpus < 1:
        raise PlacementError(f"backend nccl needs a GPU per rank but this host shows {gpus} GPUs "
                             "(check CUDA_VISIBLE_DEVICES); use --backend gloo to train on the CPU")
    too_big = {g: n for g, n in enumerate(sizes) if n > gpus}
    if too_big and not fit:
        which = ", ".join(f"group {g} has {_plural(n, 'rank')}" for g, n in too_big.items())
        raise PlacementError(
            f"this host has {_plural(gpus, 'GPU')} but {which}, and NCCL cannot put two ranks of one group on "
            f"one GPU; ask for at most {_plural(gpus, 'rank')} per group (--ranks-per-group / --group-sizes) "
            "or use --backend gloo (CPU)")
    placed = [min(n, gpus) for n in sizes]
    devices, first = [], 0
    for n in placed:
        devices.append(tuple((first + r) % gpus for r in range(n)))
        first += n
    return DevicePlan(gpus, tuple(devices), tuple(sizes))


def parse_device_map(text: str) -> list[int]:
    """``"0,1,3"`` as CUDA indices; PlacementError on anything else (negative, repeated, not a number)."""
    try:
        indices = [int(x) for x in text.split(",")]
    except ValueError:
        raise PlacementError(f"{DEVICE_MAP_ENV} must be comma-separated GPU indices, got {text!r}") from None
    if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise PlacementError(f"{DEVICE_MAP_ENV}={text!r}: indices must be >= 0 and distinct "
                             "(NCCL cannot put two ranks of one group on one GPU)")
    return indices


def rank_cuda_index(local_rank: int, gpus: int, env: Mapping[str, str], *, group: int, rank: int) -> int:
    """The CUDA index rank ``rank`` of group ``group`` uses: entry ``local_rank`` of
    ``DILOCO_DEVICE_MAP`` when set (diloco run sets it), else ``local_rank + DILOCO_GPU_OFFSET``.
    PlacementError, naming the group, rank, index and ``gpus`` (the host's visible GPUs), when the
    index is not one of them."""
    who = f"group {group} rank {rank} (LOCAL_RANK {local_rank})"
    if env.get(DEVICE_MAP_ENV):
        indices = parse_device_map(env[DEVICE_MAP_ENV])
        if local_rank >= len(indices):
            raise PlacementError(f"{who}: {DEVICE_MAP_ENV}={env[DEVICE_MAP_ENV]!r} lists only "
                                 f"{_plural(len(indices), 'GPU')}")
        index, how = indices[local_rank], f"{DEVICE_MAP_ENV}={env[DEVICE_MAP_ENV]!r}"
    else:
        try:
            offset = int(env.get(GPU_OFFSET_ENV) or 0)
        except ValueError:
            raise PlacementError(f"{GPU_OFFSET_ENV} must be an integer, got {env[GPU_OFFSET_ENV]!r}") from None
        if offset < 0:
            raise PlacementError(f"{GPU_OFFSET_ENV} must be >= 0, got {offset}")
        index, how = local_rank + offset, f"LOCAL_RANK {local_rank} + {GPU_OFFSET_ENV} {offset}"
    if not 0 <= index < gpus:
        shown = f"{_plural(gpus, 'GPU')} (indices 0..{gpus - 1})" if gpus else "no GPU"
        raise PlacementError(
            f"{who} would use GPU cuda:{index} ({how}) but this host shows {shown}; check "
            f"CUDA_VISIBLE_DEVICES, start fewer ranks per node, lower {GPU_OFFSET_ENV}, or use --backend gloo")
    return index


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _groups_text(sizes: list[int]) -> str:
    if len(set(sizes)) == 1:
        return f"{_plural(len(sizes), 'group')} × {_plural(sizes[0], 'rank')}"
    return f"{_plural(len(sizes), 'group')} ({', '.join(map(str, sizes))} ranks)"
