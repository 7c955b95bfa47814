"""One rank of one worker group: the training loop run under ``torchrun``.

Inside the group the ranks are an ordinary DDP job (Gloo on CPU, NCCL on GPU). Across groups,
each rank opens its own data-plane endpoint, joins the coordinator with its address, and the
DiLoCo engine averages pseudo-gradients through ``StripedAverager`` every H inner steps.

Environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (set by torchrun), ``DILOCO_SECRET``
(hex shared secret of the data plane) and optionally ``DILOCO_TOKEN`` (coordinator token).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from diloco import checkpoint
from diloco.config import Config
from diloco.connection import SECRET_ENV, TOKEN_ENV, GroupConnection, connect, read_secret
from diloco.data_parallel import DataParallelAcrossGroups
from diloco.engine import DiLoCo
from diloco.outer import by_name, co2
from diloco.schedule import FixedSchedule, QSRSchedule, SyncSchedule, inner_lr
from diloco.task import DEMO_ENTRY, Task, TaskContext, batch_items, build_task, parse_entry_args, to_device

__all__ = ["SECRET_ENV", "TOKEN_ENV", "WorkerError", "main", "make_engine", "run_worker"]


class WorkerError(RuntimeError):
    """A worker cannot start or continue; the message says why."""


def make_schedule(cfg: Config) -> SyncSchedule:
    """The sync schedule a config asks for, capped at the run's total inner steps."""
    s = cfg.sync
    h_max = s.h_max or None
    if s.schedule == "qsr":
        return QSRSchedule(
            h_base=s.h, alpha=s.qsr_alpha, gamma=s.qsr_gamma,
            warmup_steps=cfg.inner.warmup_steps, total_steps=cfg.train.steps, h_max=h_max,
        )
    return FixedSchedule(s.h, total_steps=cfg.train.steps, h_max=h_max)


def make_inner_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """Inner optimizer; weight decay on matrices only (not biases, norms)."""
    i = cfg.inner
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": i.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if i.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=i.lr, betas=(0.9, 0.99))
    if i.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=i.lr, betas=(0.9, 0.99))
    if i.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=i.lr, momentum=0.9)
    raise WorkerError(f"unknown inner optimizer {i.optimizer!r}")


def make_engine(cfg: Config, model: nn.Module, inner: torch.optim.Optimizer, averager, fragments=None):
    """The engine a config asks for: ``DiLoCo`` in the configured mode, or data parallel.
    ``fragments(model, P)``: the task's split for ``--fragments`` (default: ``partition``)."""
    s, o = cfg.sync, cfg.outer
    if s.mode == "dp":
        return DataParallelAcrossGroups(model, averager, initial_sync=cfg.train.initial_sync)
    if s.mode == "co2":
        penalty = o.co2_penalty if o.co2_penalty == "adaptive" else float(o.co2_penalty)
        outer = co2(o.co2_lr, o.co2_momentum, o.co2_clip, penalty)
    else:
        outer = by_name(o.optimizer, o.lr, o.momentum)
    split = None if s.fragments == 1 else (fragments(model, s.fragments) if fragments else s.fragments)
    return DiLoCo(
        model, inner, averager=averager, sync_every=make_schedule(cfg), mode=s.mode, fragments=split,
        overlap_steps=s.overlap_steps if s.mode == "overlap" else 0, merge_alpha=o.merge_alpha(s.mode),
        outer_optimizer=outer, global_device="cpu" if o.device == "cpu" else "model",
        initial_sync=cfg.train.initial_sync,
    )


def _resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise WorkerError("backend nccl was asked for but CUDA is not available")
    return requested


def _device(backend: str, local_rank: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)
    return device


def run_worker(cfg: Config, group: int, coordinator: str) -> dict:
    """Train this rank; returns this rank's summary (rank 0's carries the eval loss)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= group < cfg.topology.groups:
        raise WorkerError(f"--group-id {group} outside [0, {cfg.topology.groups})")
    if world != cfg.topology.sizes()[group]:
        raise WorkerError(f"torchrun started {world} ranks but the config gives group {group} {cfg.topology.sizes()[group]}")
    torch.set_num_threads(cfg.topology.threads_per_rank)
    backend = _resolve_backend(cfg.topology.backend)
    device = _device(backend, local_rank)
    secret = read_secret()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.transport.timeout_s))
    link = None
    try:
        ctx = TaskContext(group=group, num_groups=cfg.topology.groups, rank=rank, group_size=world, device=device,
                          seed=cfg.train.seed, steps=cfg.train.steps, batch_size=cfg.data.batch_size,
                          data_path=cfg.data.path, args=parse_entry_args(cfg.train.entry_args), config=cfg)
        task = build_task(cfg.train.entry or DEMO_ENTRY, ctx)
        model = task.model.to(device)
        ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
        inner = make_inner_optimizer(cfg, model)
        link = connect(coordinator, group, secret=secret, settings=cfg.transport, metrics_port=cfg.train.metrics_port)
        engine = make_engine(cfg, model, inner, link, task.fragments)
        return _train(cfg, group, rank, device, ddp, task, inner, engine, link)
    finally:
        if link is not None:
            link.close()
        dist.destroy_process_group()


def _train(cfg: Config, group: int, rank: int, device: torch.device, ddp: nn.Module, task: Task,
           inner: torch.optim.Optimizer, engine, link: GroupConnection) -> dict:
    c = cfg.inner
    steps = cfg.train.steps
    data_parallel = isinstance(engine, DataParallelAcrossGroups)
    evaluate = functools.partial(_evaluate, ddp.module, task, device)
    initial_eval = evaluate() if rank == 0 else float("nan")
    batches = iter(task.train_batches)
    items_per_batch = task.tokens_per_batch
    loss_ema = None
    for t in range(steps):
        lr = inner_lr(t, peak=c.lr, warmup_steps=c.warmup_steps, total_steps=steps,
                      schedule=c.lr_schedule, min_ratio=c.min_lr_ratio)
        for pg in inner.param_groups:
            pg["lr"] = lr
        try:
            batch = to_device(next(batches), device)
        except StopIteration:
            raise WorkerError(f"the task's train_batches ran out after {t} of {steps} steps") from None
        if items_per_batch is None:
            items_per_batch = batch_items(batch)
        loss = task.loss(ddp, batch)
        inner.zero_grad(set_to_none=True)
        loss.backward()
        if data_parallel:
            engine.average_gradients()
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), c.grad_clip)
        inner.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise WorkerError(f"group {group} rank {rank}: inner loss is {value} at step {t + 1}")
        loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
        # the lr the next round starts with: what QSR reads when it sets H after this sync
        nxt = inner_lr(min(t + 1, steps - 1), peak=c.lr, warmup_steps=c.warmup_steps, total_steps=steps,
                       schedule=c.lr_schedule, min_ratio=c.min_lr_ratio)
        for pg in inner.param_groups:
            pg["lr"] = nxt
        events = engine.step()
        if t + 1 == steps:
            events = engine.close()
        if (t + 1) % cfg.train.log_every == 0 or t + 1 == steps or events:
            link.report_progress(loss=loss_ema, step=t + 1, steps=steps, lr=nxt,
                                 tokens_per_step=(items_per_batch or 0) * link.group_size)
    with engine.global_weights():
        eval_loss = evaluate() if rank == 0 else float("nan")
    summary = link.summary(
        engine, eval_loss=eval_loss, initial_eval_loss=initial_eval, final_train_loss=loss_ema,
        tokens=steps * (items_per_batch or 0) * link.group_size, entry=cfg.train.entry or DEMO_ENTRY,
    )
    if cfg.train.save and group == 0 and rank == 0:
        checkpoint.save(cfg.train.save, {
            "global": engine.global_state_dict(), "config": cfg.to_dict(),
            "inner_steps": steps, "eval_loss": eval_loss, "param_hash": summary["param_hash"],
        })
        summary["checkpoint"] = cfg.train.save
    return summary


@torch.no_grad()
def _evaluate(model: nn.Module, task: Task, device: torch.device) -> float:
    """Mean of ``task.loss`` over ``task.eval_batches`` (NaN when the task has none)."""
    if not task.eval_batches:
        return float("nan")
    was_training = model.training
    model.eval()
    total = sum(float(task.loss(model, to_device(b, device))) for b in task.eval_batches)
    model.train(was_training)
    return total / len(task.eval_batches)


def format_worker_line(s: dict) -> str:
    """One line per rank at the end: what it did (rank 0's carries the group's eval loss)."""
    loss = s.get("eval_loss", float("nan"))
    shown = f"eval loss {loss:.4f} (initial {s.get('initial_eval_loss', float('nan')):.4f}), " if math.isfinite(loss) else ""
    return (f"diloco worker group {s['group']} rank {s['rank']}: {shown}{s['inner_steps']} steps, "
            f"{s['outer_rounds']} syncs, {s['bytes_sent']:,} B sent by the group, "
            f"global params {s['param_hash']}, {s['seconds']:.1f} s, utilization {100 * s['utilization']:.1f}%")


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process if its parent (the torchrun agent) dies first."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def main(cfg: Config, group: int, coordinator: str, json_path: str | None = None) -> int:
    """Entry point of ``diloco worker``; returns the process exit code. Prints this rank's
    summary line; rank 0 writes the group's summary to ``json_path`` if given."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_parent()
    try:
        summary = run_worker(cfg, group, coordinator)
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear line and exit code 1
        rank = os.environ.get("RANK", "?")
        if os.environ.get("DILOCO_TRACEBACK"):
            traceback.print_exc()
        print(f"diloco worker (group {group}, rank {rank}): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    print(format_worker_line(summary), flush=True)
    if json_path and summary.get("rank") == 0:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
