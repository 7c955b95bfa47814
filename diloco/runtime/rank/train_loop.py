"""The training loop of one rank: inner steps, the engine's exchanges between them, progress,
job checkpoints and the stop they allow, then the final evaluation and the rank's summary.
``diloco.runtime.rank.worker`` starts a rank (device, process group, task, engine, healing or
resuming) and hands it here."""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn

from diloco.engine.data_parallel import DataParallelAcrossGroups
from diloco.engine.schedule import inner_lr
from diloco.exchange.data_positions import merged
from diloco.job.config import Config, ConfigError, InnerConfig
from diloco.job.task import DEMO_ENTRY, Task, batch_items, to_device
from diloco.runtime.checkpoints import checkpoint, job_checkpoint, rank_state
from diloco.runtime.ops import exit_codes
from diloco.runtime.rank import data_feed, group_parallel
from diloco.runtime.rank.connection import GroupConnection


log = logging.getLogger("diloco.runtime.rank.worker")


class WorkerError(RuntimeError):
    """A worker cannot start or continue; the message says why."""


@dataclass(frozen=True)
class LoopOptions:
    """What the training loop reads of a job's settings, built by the worker from its config."""

    steps: int  # --steps: inner steps of the whole job
    inner: InnerConfig  # the inner optimizer's lr schedule and gradient clipping (``Config.inner``)
    log_every: int  # --log-every: a progress report every this many steps
    stop_grace: float  # --stop-grace: seconds a SIGTERM's checkpoint may take
    entry: str  # the task's --entry, as the summary names it
    save: str  # --save: the file of the final global model ("": none)
    checkpoints: job_checkpoint.CheckpointOptions | None  # job checkpoints (None: none)
    config: Config  # the job's config as it runs: what --save records

    @classmethod
    def of(cls, cfg: Config) -> LoopOptions:
        """The loop's options in the job ``cfg`` (as it runs: after ``--codec/--h auto`` chose)."""
        t = cfg.train
        checkpoints = job_checkpoint.CheckpointOptions.of(cfg) if t.checkpoint_every or t.stop_after or \
            t.checkpoint_dir else None
        return cls(steps=t.steps, inner=cfg.inner, log_every=t.log_every, stop_grace=t.stop_grace,
                   entry=t.entry or DEMO_ENTRY, save=t.save, checkpoints=checkpoints, config=cfg)


def _restore(restored: job_checkpoint.RankCheckpoint, **objects) -> rank_state.Progress:
    try:
        return rank_state.restore(restored.state, **objects)
    except (ValueError, RuntimeError, KeyError, TypeError) as e:
        raise checkpoint.CheckpointError(f"{restored.path}: cannot be restored here: {e}") from e


def on_sigterm(keeper: job_checkpoint.JobCheckpointer | None, stop_grace_s: float) -> None:
    """SIGTERM (main thread only): the first asks ``keeper`` to checkpoint and stop at the next
    step the job agrees on (a periodic checkpoint, or the connection's ``stop_requested``) and
    gives it ``stop_grace_s`` seconds: past them the rank exits 75 without that checkpoint (the
    pod's grace period would end in SIGKILL, which counts against its Job's budget; a restarted
    group heals from a live one). A second SIGTERM, or the first without periodic checkpoints or
    with no grace, ends the process at once. Each says so in the log."""
    if threading.current_thread() is not threading.main_thread():
        return

    def overdue() -> None:
        if keeper.stopped:
            log.warning("SIGTERM: checkpoint %s written, but the rest of the stop (its report) took more than "
                        "--stop-grace %gs: stopping now, exit %s", keeper.last, stop_grace_s,
                        exit_codes.describe(exit_codes.RESTART))
        else:
            log.warning("SIGTERM: no job checkpoint within --stop-grace %gs: stopping now without one, exit %s "
                        "(a restarted group heals from a live one)", stop_grace_s,
                        exit_codes.describe(exit_codes.RESTART))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_codes.RESTART)

    def handler(signum, frame) -> None:
        if keeper is None or keeper.stop_signalled or not keeper.every or stop_grace_s <= 0:
            log.warning("SIGTERM: %s", "no job checkpoints (no --checkpoint-dir, or rounds by time): stopping now, "
                        "without a checkpoint (a restarted group heals from a live one)" if keeper is None else
                        "stopping now (a second SIGTERM)" if keeper.stop_signalled else
                        "no periodic checkpoint to stop at (--checkpoint-every 0): stopping now, without a "
                        "checkpoint (a restarted group heals from a live one)" if not keeper.every else
                        "--stop-grace 0: stopping now, without a checkpoint (a restarted group heals from a live one)")
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)  # killed by SIGTERM: diloco torchrun exits 75 (restart me)
            return
        log.warning("SIGTERM: checkpointing at the next multiple of --checkpoint-every %d, then stopping, "
                    "or in %gs (--stop-grace) without it (SIGTERM again: stop now)", keeper.every, stop_grace_s)
        keeper.request_stop()
        keeper.stop_timer = threading.Timer(stop_grace_s, overdue)
        keeper.stop_timer.daemon = True
        keeper.stop_timer.name = "diloco-stop-grace"
        keeper.stop_timer.start()

    signal.signal(signal.SIGTERM, handler)


def train(opts: LoopOptions, group: int, rank: int, device: torch.device, ddp: nn.Module, task: Task,
          inner: torch.optim.Optimizer, engine, link: GroupConnection,
          restored: job_checkpoint.RankCheckpoint | None = None) -> dict:
    """Run this rank's inner steps to the end of the job (or to a stop with a job checkpoint),
    then evaluate and return its summary. ``opts``: the job's settings the loop reads;
    ``restored``: a job checkpoint to continue from (None: the job's start, or a group that just
    healed into it)."""
    c = opts.inner
    steps = opts.steps
    data_parallel = isinstance(engine, DataParallelAcrossGroups)
    eval_global = functools.partial(evaluate, group_parallel.bare(ddp), task, device)
    feed = data_feed.DataFeed(task.train_batches, getattr(link.averager, "positions", None), group=group, rank=rank)
    batches = feed.batches
    items_per_batch = task.tokens_per_batch
    timed = getattr(engine, "time_rounds", None) is not None  # --round-seconds: the loop ends with the rounds
    if timed and restored is not None:
        raise ConfigError("--resume with --round-seconds is not supported: rounds by time take no job checkpoints")
    if restored is None:
        # a group that healed into a running job continues at the job's step, its data at its committed position
        start_step, loss_ema = engine.inner_step, None
        if link.fault_stats.healed:
            feed.healed()
        initial_eval = group_parallel.evaluate_on(rank, ddp, eval_global) if start_step == 0 else float("nan")
    else:  # engine, local model, inner optimizer, data position, then the RNG states
        progress = _restore(restored, engine=engine, model=group_parallel.bare(ddp), inner=inner, task=task, batches=batches,
                            device=device)
        start_step, loss_ema, initial_eval = progress.step, progress.loss_ema, progress.initial_eval_loss
        link.periods = list(progress.periods)  # H of the rounds before the checkpoint, for the summary
        feed.resumed(restored.state)
    keeper = None
    if not timed and opts.checkpoints is not None:
        keeper = job_checkpoint.JobCheckpointer(
            opts.checkpoints, group=group, rank=rank, group_size=link.group_size, engine=engine, model=group_parallel.bare(ddp), inner=inner,
            task=task, link=link, device=device, start_step=start_step, initial_eval_loss=initial_eval,
            healed=restored is None and link.fault_stats.healed)
    on_sigterm(keeper, opts.stop_grace)  # says what it does either way; run_worker puts the old handler back
    stopped_at = start_step if keeper is not None and keeper.catch_up(loss_ema=loss_ema) else None
    t = start_step
    while stopped_at is None and (not engine.rounds_done if timed else t < steps):
        # rounds by time: the lr follows the job's progress in time, alike in every group whatever its speed
        lr_step = min(int(engine.progress() * steps), steps - 1) if timed else t
        lr = inner_lr(lr_step, peak=c.lr, warmup_steps=c.warmup_steps, total_steps=steps,
                      schedule=c.lr_schedule, min_ratio=c.min_lr_ratio)
        for pg in inner.param_groups:
            pg["lr"] = lr
        # the lr the next round starts with: what QSR reads when it sets H after this sync
        nxt = inner_lr(min(lr_step + 1, steps - 1), peak=c.lr, warmup_steps=c.warmup_steps, total_steps=steps,
                       schedule=c.lr_schedule, min_ratio=c.min_lr_ratio)
        if getattr(engine, "catching_up", False) and engine.steps_behind() > 0:
            # healed into rounds of fixed H: its state transfer made it late; it counts this step
            # untrained (no batch drawn, no weight) so that it launches its first exchange with the others
            for pg in inner.param_groups:
                pg["lr"] = nxt
            events = engine.skip_step()
        else:
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
                torch.nn.utils.clip_grad_norm_(group_parallel.bare(ddp).parameters(), c.grad_clip)
            inner.step()
            value = float(loss.detach())
            if not math.isfinite(value):
                raise WorkerError(f"group {group} rank {rank}: inner loss is {value} at step {t + 1}")
            loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
            for pg in inner.param_groups:
                pg["lr"] = nxt
            events = engine.step()
            feed.after_step()
        last = engine.rounds_done if timed else t + 1 == steps
        if last:
            events = engine.close()
        if (t + 1) % opts.log_every == 0 or last or events:
            link.report_progress(loss=loss_ema, step=t + 1, steps=steps, lr=nxt,
                                 tokens_per_step=(items_per_batch or 0) * link.group_size)
        if keeper is not None and keeper.after_step(t + 1, loss_ema=loss_ema):
            stopped_at = t + 1  # checkpoint written: leave the job here, to be resumed
            keeper.stopped = True
            break
        t += 1
    own_stop = stopped_at is not None and keeper.stop_signalled and not getattr(link, "stop_requested", False)
    if keeper is not None and keeper.stop_timer is not None and not own_stop:
        keeper.stop_timer.cancel()  # trained to the end, or a stop the job agreed on: its exit, not the SIGTERM's
    if own_stop:  # this rank's own SIGTERM: its grace period is running, so no final eval
        eval_loss = float("nan")
    else:
        with engine.global_weights():
            eval_loss = group_parallel.evaluate_on(rank, ddp, eval_global)
    extra = {}
    if restored is not None:
        extra.update(resumed_from=str(restored.path.parent), resumed_at_step=start_step)
    if stopped_at is not None:
        extra.update(stopped_at_step=stopped_at, job_checkpoint=str(keeper.last))
        if own_stop:
            extra.update(stopped_by="SIGTERM")  # this rank's own SIGTERM, not a stop the job agreed on: exit 75
    if feed.positions is not None:  # this incarnation's committed data ranges (diloco.exchange.data_positions)
        extra.update(data_ledger=merged(feed.positions.ledger),
                     data_unit="samples" if feed.positions.samples_per_step else "steps")
    whole = group_parallel.global_model_to_save(engine, ddp, rank) if (opts.save or task.export is not None) \
        and group == 0 and stopped_at is None else None  # sharded: every rank of the group takes part; rank 0 gets it
    if whole is not None and task.export is not None:  # the task's own format (save_pretrained ...)
        extra.update(exported=task.export(whole))
    summary = link.summary(
        engine, eval_loss=eval_loss, initial_eval_loss=initial_eval, final_train_loss=loss_ema,
        tokens=(stopped_at or t) * (items_per_batch or 0) * link.group_size, entry=opts.entry, **extra,
    )
    if whole is not None and opts.save:
        checkpoint.save(opts.save, {
            "global": whole, "config": opts.config.to_dict(),
            "inner_steps": steps, "eval_loss": eval_loss, "param_hash": summary["param_hash"],
        })
        summary["checkpoint"] = opts.save
    return summary


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, device: torch.device) -> float:
    """Mean of ``task.loss`` over ``task.eval_batches`` (NaN when the task has none)."""
    if not task.eval_batches:
        return float("nan")
    was_training = model.training
    model.eval()
    total = sum(float(task.loss(model, to_device(b, device))) for b in task.eval_batches)
    model.train(was_training)
    return total / len(task.eval_batches)
