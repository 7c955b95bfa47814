"""What ``diloco worker`` trains: a ``Task`` (model, batches, loss), built by an entry function.

A user brings a model by naming a function ``--entry package.module:function`` that takes a
``TaskContext`` and returns a ``Task``; everything else (topology, sync modes, codecs, links,
metrics, checkpoints, summaries) is the same as for the demo, whose own entry is
``diloco.demo:gpt_task``::

    def make_task(ctx: diloco.TaskContext) -> diloco.Task:
        torch.manual_seed(ctx.seed)                       # the same initial weights in every group
        model = MyNet()
        data = MyData(shard=ctx.group, num_shards=ctx.num_groups, rank=ctx.rank)
        return diloco.Task(model=model, train_batches=iter(data), loss=lambda m, b: F.mse_loss(m(b[0]), b[1]),
                           eval_batches=[...])

The worker moves each batch's tensors (a tensor, or a tuple/list/dict of them) to the rank's
device, calls ``loss(ddp_model, batch)``, steps the inner optimizer, and runs the engine.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from diloco.job.config import Config
from diloco.job.data_source import is_data_source

DEMO_ENTRY = "diloco.demo:gpt_task"  # what --entry "" trains
# entries of one release ago, still accepted: the demo moved from diloco.task to diloco.demo
RENAMED_ENTRIES = {"diloco.task:gpt_task": DEMO_ENTRY}


class TaskError(ValueError):
    """An entry point cannot be found or returned something that is not a usable ``Task``."""


@dataclass(frozen=True)
class TaskContext:
    """What an entry function knows about where it runs."""

    group: int  # this group's id, 0..num_groups-1
    num_groups: int
    rank: int  # this rank within its group, 0..group_size-1
    group_size: int
    device: torch.device  # where the worker will put the model and the batches
    seed: int  # --seed: seed the model's initialization with it so every group starts the same
    steps: int  # inner steps this rank will take
    batch_size: int  # --batch-size
    data_path: str  # --data ("" if not given)
    args: dict[str, str] = field(default_factory=dict)  # --entry-args KEY=VALUE,...
    config: Config | None = None  # the whole configuration

    @classmethod
    def for_job(cls, cfg: Config, group: int, rank: int, group_size: int, device: torch.device) -> TaskContext:
        """The context of rank ``rank`` (of ``group_size``) of group ``group`` on ``device`` in the job ``cfg``
        describes: the one place a job's config becomes what an entry function knows."""
        return cls(group=group, num_groups=cfg.topology.groups, rank=rank, group_size=group_size, device=device,
                   seed=cfg.train.seed, steps=cfg.train.steps, batch_size=cfg.data.batch_size,
                   data_path=cfg.data.path, args=parse_entry_args(cfg.train.entry_args), config=cfg)


@dataclass
class Task:
    """A model, its training batches, its loss, and optionally held-out batches to evaluate.

    ``train_batches``: yields at least ``steps`` batches. ``loss(model, batch)``: a scalar
    tensor to minimize (the model passed in may be DDP-wrapped). ``eval_batches``: evaluated
    with the global parameters at the start and the end (mean loss). ``tokens_per_batch``: what
    throughput and the summary's ``tokens`` count per batch (tokens, samples, ...); default the
    leading dimension of the batch's first tensor. ``fragments``: parameter-name lists for
    ``--fragments`` (default ``diloco.engine.fragments.partition(model, P)``). ``shard``: the task
    asks for its model to be sharded inside the group with FSDP2 (``--parallel auto``, the
    default, then shards it; ``--parallel fsdp`` always does, ``ddp`` never): ``True`` for each
    block of every ``nn.ModuleList``, or the units ``diloco.shard_model`` takes (module names, a
    module class, a predicate ``f(name, module)``). ``export``: called once at the end of a job
    that trained to the end, on rank 0 of group 0, with the final global parameters (whole fp32
    tensors by parameter name); it writes them in a format of its own and returns where (the
    summary's ``exported``), as ``diloco.integrations.hf`` writes ``save_pretrained`` directories.

    ``train_batches`` is a plain iterator, or a resumable data source
    (``diloco.job.data_source.DataSource``: a stream whose position is a group-level sample
    counter, with ``state()`` / ``load_state()``). Only a data source is trained once: its
    group's committed position is part of the state the job commits, rolls back, checkpoints and
    hands to a healer, so across kills, refused contributions, heals and resumes no sample is
    counted twice or skipped (``diloco.exchange.data_positions``). A plain iterator cannot promise
    that: a group that heals starts it afresh (its first batches are trained again), and the
    batches of a refused contribution are not drawn again.

    Resuming (``--resume``): ``data_state()`` returns the position of ``train_batches`` after the
    batches taken so far (tensors and plain values: it is saved with ``torch.save`` and read
    with ``weights_only=True``), ``load_data_state(state)`` restores it before the next batch is
    taken; a data source's ``state`` / ``load_state`` are used when neither is given. A task
    without them is resumed by drawing and discarding the batches already used, which continues
    exactly when ``train_batches`` is a deterministic stream (seeded).
    """

    model: nn.Module
    train_batches: Iterable[Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    eval_batches: Sequence[Any] | None = None
    tokens_per_batch: int | None = None
    fragments: Callable[[nn.Module, int], list[list[str]]] | None = None
    data_state: Callable[[], dict[str, Any]] | None = None
    load_data_state: Callable[[dict[str, Any]], None] | None = None
    shard: Any = None
    export: Callable[[dict[str, torch.Tensor]], str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TaskError(f"Task.model must be an nn.Module, got {type(self.model).__name__}")
        if not callable(self.loss):
            raise TaskError("Task.loss must be callable as loss(model, batch) -> scalar tensor")
        if (self.data_state is None) != (self.load_data_state is None):
            raise TaskError("Task.data_state and Task.load_data_state go together (give both or neither)")
        if self.export is not None and not callable(self.export):
            raise TaskError("Task.export must be callable as export(params_by_name) -> where it wrote them")
        if self.data_state is None and is_data_source(self.train_batches):
            self.data_state, self.load_data_state = self.train_batches.state, self.train_batches.load_state
        s = self.shard
        if not (s is None or s is True or isinstance(s, (str, type, list, tuple, nn.Module)) or callable(s)):
            raise TaskError("Task.shard must be None, True, module names, a module class or a predicate "
                            f"f(name, module), got {self.shard!r}")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested tuples, lists, dicts) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def batch_items(batch: Any) -> int:
    """Leading dimension of the first tensor found in ``batch`` (0 if none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for b in items:
        n = batch_items(b)
        if n:
            return n
    return 0


def parse_entry_args(text: str) -> dict[str, str]:
    """``"a=1,b=x"`` -> ``{"a": "1", "b": "x"}``."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise TaskError(f"--entry-args wants KEY=VALUE pairs separated by commas, got {part!r}")
        out[key.strip()] = value.strip()
    return out


def load_entry(spec: str) -> Callable[[TaskContext], Task]:
    """Import ``package.module:function`` and return the function. As with ``python -m``, the
    current directory is searched first (then PYTHONPATH and the installed packages)."""
    module_name, sep, attr = RENAMED_ENTRIES.get(spec, spec).partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"--entry must look like package.module:function, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(f"--entry {spec}: cannot import {module_name!r}: {e}") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise TaskError(f"--entry {spec}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TaskError(f"--entry {spec}: {attr!r} is not callable")
    return fn  # type: ignore[return-value]


def build_task(spec: str, ctx: TaskContext) -> Task:
    """Call the entry function and check what it returned."""
    task = load_entry(spec)(ctx)
    if not isinstance(task, Task):
        raise TaskError(f"--entry {spec} returned {type(task).__name__}, not a diloco.Task")
    return task
