"""One rank of one worker group, run under ``torchrun``: its start (device, process group, task,
connection, engine; healing into a running job or resuming a checkpoint), then the training loop
(``diloco.runtime.rank.train_loop``).

Inside the group the ranks are an ordinary DDP job (Gloo on CPU, NCCL on GPU), or with
``--parallel fsdp`` an FSDP2 one (``diloco.runtime.rank.group_parallel``). Across groups,
each rank opens its own data-plane endpoint, joins the coordinator with its address, and the
DiLoCo engine averages pseudo-gradients through ``StripedAverager`` every H inner steps.

Environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (set by torchrun), ``DILOCO_SECRET``
(hex shared secret of the data plane) and optionally ``DILOCO_TOKEN`` (coordinator token). With
NCCL, the GPU of each rank: ``DILOCO_DEVICE_MAP`` (set by ``diloco run``) or ``LOCAL_RANK`` +
``DILOCO_GPU_OFFSET`` (see ``diloco.runtime.rank.device_placement``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from compress.codec_spec import CodecSpec
from diloco.coordinator.membership import Membership
from diloco.engine.data_parallel import DataParallelAcrossGroups
from diloco.engine.diloco import DiLoCo
from diloco.engine.modes import MODE_TRAITS
from diloco.engine.outer_spec import OuterSpec
from diloco.engine.schedule import SyncSchedule
from diloco.exchange.heartbeat import GroupEvicted, JobHalted
from diloco.exchange.quorum_averager import JobFinished
from diloco.job import auto_choice
from diloco.job.config import Config, ConfigError, InnerConfig, SyncConfig
from diloco.job.task import DEMO_ENTRY, TaskContext, build_task
from diloco.runtime.checkpoints import job_checkpoint
from diloco.runtime.checkpoints.checkpoint import CheckpointError
from diloco.runtime.ops import exit_codes
from diloco.runtime.rank import (auto_setting, cpu_threads, device_placement, group_parallel, kernels, train_loop,
                                 user_errors)
from diloco.runtime.rank.connection import GroupConnection, connect
from diloco.runtime.rank.endpoint import SECRET_ENV, TOKEN_ENV, read_secret
from diloco.runtime.rank.train_loop import WorkerError

__all__ = ["SECRET_ENV", "TOKEN_ENV", "WorkerError", "engine_options", "main", "make_engine", "run_worker"]

log = logging.getLogger(__name__)


def make_schedule(cfg: Config) -> SyncSchedule:
    """The sync schedule a config asks for, capped at the run's total inner steps."""
    return cfg.schedule_spec().build()


def make_inner_optimizer(i: InnerConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer of ``i`` (``Config.inner``); weight decay on matrices only (not biases, norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": i.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if i.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=i.lr, betas=(0.9, 0.99))
    if i.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=i.lr, betas=(0.9, 0.99))
    if i.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=i.lr, momentum=0.9)
    raise ConfigError(f"unknown inner optimizer {i.optimizer!r}")


def make_engine(model: nn.Module, inner: torch.optim.Optimizer, averager, fragments=None, *, sync: SyncConfig,
                outer: OuterSpec, outer_device: str, schedule: SyncSchedule, final_codec: CodecSpec | None,
                initial_sync: bool, clock: Callable[[], float] = time.monotonic) -> DiLoCo | DataParallelAcrossGroups:
    """The engine the specs ask for: ``DiLoCo`` in ``sync``'s mode (the config's ``sync`` section), or
    data parallel. ``outer``: the outer rule (``OuterConfig.spec()``), its fp32 global copy on
    ``outer_device`` (``--outer-device``); ``schedule``: the sync schedule (``Config.schedule_spec().build()``);
    ``final_codec``: the last exchange's codec (``CodecSpec.final()``, None: the run's own);
    ``fragments(model, P)``: the task's split for ``--fragments`` (default: ``partition``).
    ``clock``: what rounds by time (``--round-seconds``) measure their seconds on.
    ``engine_options(cfg)`` gives all of them from a whole config."""
    s = sync
    if s.mode == "dp":
        return DataParallelAcrossGroups(model, averager, initial_sync=initial_sync)
    split = None if s.fragments == 1 else (fragments(model, s.fragments) if fragments else s.fragments)
    return DiLoCo(
        model, inner, averager=averager, sync_every=schedule, mode=s.mode, fragments=split,
        overlap_steps=s.overlap_steps if MODE_TRAITS[s.mode].takes_tau else 0, merge_alpha=outer.alpha_for(s.mode),
        outer_optimizer=outer.build(s.mode), global_device="cpu" if outer_device == "cpu" else "model",
        initial_sync=initial_sync, round_vote=_group_round_vote(), clock=clock,
        final_codec=_built(final_codec), residual_decay=outer.residual_decay,
    )


def engine_options(cfg: Config, schedule: SyncSchedule | None = None) -> dict:
    """``make_engine``'s settings from a whole config (``Config.engine_options``), the schedule
    ``make_schedule``'s unless one is given (``--codec/--h auto``)."""
    return cfg.engine_options(schedule or make_schedule(cfg))


def _built(spec: CodecSpec | None):
    """The codec a spec names, or None for no spec."""
    return None if spec is None else spec.build()


def _group_round_vote():
    """A group of several ranks: rank 0's verdict broadcast to the group, so every rank acts on
    the same step (DDP): with rounds by time, a bit mask of the fragments whose round ends at this
    step (every step); after a heal into rounds of fixed H, the steps it is behind (every step of
    its first round). None outside a process group of more than one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def vote(mine: int) -> int:
        flag = torch.tensor([int(mine)], dtype=torch.int32, device=device)
        dist.broadcast(flag, src=0)
        return int(flag.item())

    return vote


def _resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl was asked for but CUDA is not available (use --backend gloo)")
    return requested


def _device(backend: str, local_rank: int, *, group: int, rank: int) -> torch.device:
    """This rank's device: the CPU with gloo; with nccl the GPU ``device_placement.rank_cuda_index``
    picks (checked against the GPUs this process sees, made the current one)."""
    if backend != "nccl":
        return torch.device("cpu")
    index = device_placement.rank_cuda_index(local_rank, torch.cuda.device_count(), os.environ,
                                             group=group, rank=rank)
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def _init_group(backend: str, timeout: datetime.timedelta) -> None:
    """The group's process group. Under torchrun each restart of the workers gets its own key space
    in the rendezvous store: Gloo would otherwise read the dead workers' addresses and fail. A
    group of one rank started without a rendezvous (a warm spare, ``diloco.runtime.launch.spare``) needs
    no store beyond its own process."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if "MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if restart is None or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"diloco/restart-{restart}/", store), rank=rank,
                            world_size=world, timeout=timeout)


def run_worker(cfg: Config, group: int, coordinator: str, resume: str | Path | None = None) -> dict:
    """Train this rank; returns this rank's summary (rank 0's carries the eval loss). ``resume``:
    a job checkpoint (a step folder, or a folder of them: its newest step this group completed) to
    continue from when the job starts; the group heals from a live group instead, its checkpoint
    not loaded, when the job runs already or the coordinator finds it behind another group's newest
    step (``diloco.coordinator.resume``)."""
    started = time.monotonic()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= group < cfg.topology.groups:
        raise ConfigError(f"--group-id {group} outside [0, {cfg.topology.groups})")
    if world != cfg.topology.sizes()[group]:
        raise ConfigError(f"torchrun started {world} ranks but the config gives group {group} {cfg.topology.sizes()[group]}")
    if (cfg.train.checkpoint_every or cfg.train.stop_after) and not cfg.train.checkpoint_dir:
        raise ConfigError("--checkpoint-every and --stop-after need --checkpoint-dir (diloco run sets one)")
    backend = _resolve_backend(cfg.topology.backend)
    device = _device(backend, local_rank, group=group, rank=rank)
    secret = read_secret()
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm_handler = signal.getsignal(signal.SIGTERM) if main_thread else None
    _init_group(backend, datetime.timedelta(seconds=cfg.transport.timeout_s))
    threads, why = cpu_threads.threads_per_rank(cfg.topology.threads_per_rank, os.environ)
    torch.set_num_threads(threads)
    kind, sentence = kernels.describe(cfg.transport.codec)
    log.info("torch threads: %d (%s); %s", threads, why, sentence, extra={"threads": threads, "kernels": kind})
    link = None
    try:
        restored = None
        point, unreadable = _resume_point(resume, group, rank)  # loaded once the coordinator says this group resumes
        ctx = TaskContext.for_job(cfg, group, rank, world, device)
        task = build_task(cfg.train.entry or DEMO_ENTRY, ctx)
        model = task.model.to(device)
        # DDP, or the model sharded in place (--parallel fsdp)
        ddp = group_parallel.wrap(task, model, device, parallel=cfg.topology.parallel, mode=cfg.sync.mode)
        built = time.monotonic()
        auto = any(auto_choice.is_auto(cfg))  # the codec until it is decided: fp32 (the decision's exchange is exact)
        settings = dataclasses.replace(cfg.transport, codec="fp32") if cfg.transport.codec == auto_choice.AUTO else \
            cfg.transport
        job_cfg, heals = cfg, 0
        while True:  # a single-rank group declared failed heals in place: it joins again (see below)
            link = connect(coordinator, group, secret=secret, settings=settings, metrics_port=cfg.train.metrics_port,
                           heartbeat_timeout=cfg.fault.heartbeat_timeout,
                           resume_step=point.step if point is not None else -1,
                           resume_exact=point is not None and job_checkpoint.names_step(resume))
            link.progress_every_s = cfg.train.progress_every
            joined = time.monotonic()
            restored = _resume_or_heal(point, link.membership, cfg, group, rank, unreadable)
            schedule = None  # --codec/--h auto joining a running job or resuming one: built before the engine
            if auto:
                num_params = sum(p.numel() for p in group_parallel.bare(ddp).parameters())
                running = _running_auto_setting(restored, link, group)  # None: every group starts and decides
                cfg, schedule = auto_setting.settle(cfg, link, running, model=ddp, task=task, device=device,
                                                    group=group, num_params=num_params)
            try:
                # a group joining a running job heals here
                options = cfg.engine_options(schedule)
                inner = make_inner_optimizer(job_cfg.inner, model)  # a fresh one after a heal, as a restarted group's
                engine = make_engine(model, inner, link, task.fragments, **options)
                if auto and schedule is None:
                    # what auto chose follows the re-probed link
                    auto_setting.install_auto_schedule(engine, link, cfg.transport.codec_spec())
                _log_startup(started, built, joined, healed=link.membership.heal)
            except JobFinished as e:
                late = {"group": group, "rank": rank, "joined_late": True, "reason": str(e),
                        "incarnation": link.averager.incarnation}
                if rank == 0:
                    link.averager.call_coordinator("summary", lambda: link.client.report_summary(group, late))
                return late
            opts = train_loop.LoopOptions.of(cfg)  # what the loop reads of the config as it runs
            try:
                return train_loop.train(opts, group, rank, device, ddp, task, inner, engine, link, restored)
            except GroupEvicted as e:
                if not heals_in_place(world, heals, cfg.fault.max_restarts):
                    raise
                heals += 1
                log.warning("group %d was declared failed (%s): healing in place (%d of --max-restarts %d): this "
                            "process joins the job again and takes a live group's state, as a restart would, "
                            "without one", group, e, heals, cfg.fault.max_restarts)
                engine.abandon()
                link.close(failed=True)
                link = None
                started = built = time.monotonic()
                cfg, restored, point, unreadable = job_cfg, None, None, []
    finally:
        if sigterm_handler is not None:
            signal.signal(signal.SIGTERM, sigterm_handler)
        if link is not None:
            link.close()
        dist.destroy_process_group()


def _resume_point(resume: str | Path | None, group: int, rank: int) -> tuple[job_checkpoint.ResumePoint | None,
                                                                             list[str]]:
    """The checkpoint step this rank joins the job with, and the files it skipped: a named step
    folder as named; in a folder of steps the newest whose file for this rank is intact (a corrupt
    newer one is skipped, with a warning: the group joins behind and heals from the others instead
    of failing once the job started; none intact: it joins with none, see ``_resume_or_heal``)."""
    if resume is None:
        return None, []
    point = job_checkpoint.find(resume, group=group)
    if job_checkpoint.names_step(resume):
        return point, []
    intact, skipped = job_checkpoint.newest_intact_for_rank(point, group, rank)
    for why in skipped:
        log.warning("group %d rank %d: skipping a checkpoint that cannot be read: %s", group, rank, why)
    return intact, skipped


def _resume_or_heal(point: job_checkpoint.ResumePoint | None, membership: Membership, cfg: Config, group: int,
                    rank: int, unreadable: list[str] = ()) -> job_checkpoint.RankCheckpoint | None:
    """This rank's checkpoint state to continue from (``point``, read and checked now), or None when
    the group heals (``membership.heal``: the job runs already, or started from a newer step than
    ``point``'s) or has none to resume from; says which. ``unreadable``: its checkpoints that
    cannot be read; with none left and no group resuming, CheckpointError: the job is not new."""
    started_at = membership.resume_step
    if point is None and unreadable and not membership.heal:
        raise CheckpointError(f"group {group} rank {rank}: no group resumes from a checkpoint, and this group's "
                              "cannot be read (a fresh start would lose the job's training):\n  " +
                              "\n  ".join(unreadable))
    if membership.heal and started_at >= 0 and (point is None or point.step < started_at):
        if point is None:
            log.warning("group %d has no checkpoint to resume from: it heals from the groups at step %d", group,
                        started_at, extra={"resume_step": started_at})
        else:
            log.warning("group %d heals from the groups at step %d instead of resuming from step %d (%s)", group,
                        started_at, point.step, point.path, extra={"resume_step": started_at})
        return None
    if point is None:
        return None
    if membership.heal:
        log.info("the job is running: group %d heals from a live group (its checkpoint %s is not read)", group,
                 point.path)
        return None
    if started_at != point.step:  # a coordinator that does not plan resumes (an older version) says -1
        raise ConfigError(f"the coordinator started the job from checkpoint step {started_at}, but this group resumes "
                          f"from step {point.step} ({point.path}): run a coordinator of this version")
    restored = job_checkpoint.load_rank(point.path, cfg, group, rank,
                                        verified=point.checked.get(job_checkpoint.rank_file(group, rank)))
    log.info("resumed from %s at step %d", point.path, restored.step)
    return restored


def heals_in_place(group_size: int, heals: int, max_heals: int) -> bool:
    """Whether a group declared failed while it trained (a freeze, a pause longer than the
    heartbeat timeout) joins the job again in the same process instead of exiting 75 to be
    restarted: only a group of one rank (the ranks of a larger group would have to agree to,
    and a restart by torchrun's agent keeps them in step), and at most ``max_heals`` times
    (``--max-restarts``; then it exits 75 and its supervisor decides)."""
    return group_size == 1 and heals < max_heals


def _log_startup(started: float, built: float, joined: float, *, healed: bool) -> None:
    """One line: how long this rank took from ``run_worker`` to training (monotonic seconds), by part;
    a restarted group's down time is mostly this (``bench/pages/goodput.md``)."""
    ready = time.monotonic()
    parts = {"task_s": built - started, "join_s": joined - built, "engine_s": ready - joined}
    log.info("ready to train %.2f s after the worker started: task and model %.2f s, joining the job %.2f s, %s %.2f s",
             ready - started, parts["task_s"], parts["join_s"],
             "healing (its quorum, then the state)" if healed else "the engine", parts["engine_s"],
             extra={"startup_s": round(ready - started, 4), **{k: round(v, 4) for k, v in parts.items()}})


def _running_auto_setting(restored: job_checkpoint.RankCheckpoint | None, link: GroupConnection,
                          group: int) -> tuple[str, str] | None:
    """(setting, where from) of a ``--codec/--h auto`` job this group joins rather than starts:
    the checkpoint's when it resumes, the coordinator's when it heals; None when every group
    starts and decides."""
    if restored is not None:
        row = job_checkpoint.auto_row(restored.state)
        if row is None:
            raise ConfigError(f"{restored.path}: holds no --codec/--h auto setting: resume it with the flags its "
                              "config holds")
        return row, f"the setting of checkpoint {restored.path.parent.name}"
    if not link.membership.heal:
        return None
    try:
        setting, left = link.membership.setting or _wait_for_job_setting(link, group), None
    except (GroupEvicted, JobHalted) as e:  # its ranks learn it together, below
        setting, left = "", e
    # each rank asked the coordinator on its own; a setting that changed between their joins or
    # polls must not give the group's ranks two engines ("": rank 0 left the job)
    agreed = link.rank0_text(setting)
    if not agreed:
        raise left or GroupEvicted(f"group {group}: its rank 0 left the job while waiting for its --codec/--h auto "
                                   "setting")
    return agreed, "the setting of the job's latest quorum"


#: how long a healer of a --codec/--h auto job waits for the job's first exchange, which names the
#: setting it builds its engine with (a job that just started or resumed runs one within seconds)
SETTING_WAIT_S = 300.0


def _wait_for_job_setting(link: GroupConnection, group: int, wait_s: float = SETTING_WAIT_S) -> str:
    """The auto setting of the job's latest quorum, once it has run one: asked of the coordinator
    (the same join again: it answers the running membership) every second while the group stays
    a member (it heartbeats, and its links answer the others' probes). GroupEvicted past
    ``wait_s``: its restart then heals once the job has run an exchange."""
    deadline = time.monotonic() + wait_s
    log.info("group %d waits for the job's first exchange to learn its --codec/--h auto setting", group)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        if link.averager.evicted_reason is not None:  # e.g. the coordinator restarted meanwhile
            raise link.averager.departure()
        membership = link.client.join(group, link.rank, link.group_size, link.transport.address,
                                      incarnation=link.averager.incarnation)
        if membership.setting:
            return membership.setting
    raise GroupEvicted(f"group {group}: the job ran no exchange with its auto setting in {wait_s:g}s, so this group "
                       "cannot learn it to heal; restart it to heal once it has")


def format_worker_line(s: dict) -> str:
    """One line per rank at the end: what it did (rank 0's carries the group's eval loss)."""
    loss = s.get("eval_loss", float("nan"))
    shown = f"eval loss {loss:.4f} (initial {s.get('initial_eval_loss', float('nan')):.4f}), " if math.isfinite(loss) else ""
    return (f"diloco worker group {s['group']} rank {s['rank']}: {shown}{s['inner_steps']} steps, "
            f"{s['outer_rounds']} syncs, {s['bytes_sent']:,} B sent by the group, "
            f"global params {s['param_hash']}, {s['seconds']:.1f} s, utilization {100 * s['utilization']:.1f}%")


def main(cfg: Config, group: int, coordinator: str, json_path: str | None = None,
         resume: str | Path | None = None) -> int:
    """Entry point of ``diloco worker``; returns the process exit code (0 also when it stopped
    early with a job checkpoint). Prints this rank's summary line; rank 0 writes the group's
    summary to ``json_path`` if given. ``resume``: a job checkpoint to continue from. What it will
    write and bind was checked before (``diloco.cli``: ``preflight.check_worker_paths``)."""
    from diloco.runtime.ops import logs
    from diloco.runtime.ops import metrics as metrics_mod

    logs.setup(cfg.train.log_format, component="worker", group=group, rank=int(os.environ.get("RANK", "0")))
    t = cfg.transport
    metrics_mod.describe_process(codec=t.codec, codec_block=t.codec_block, link=t.link, zstd=t.zstd,
                                 chunk_bytes=t.chunk_bytes)
    try:
        summary = run_worker(cfg, group, coordinator, resume)
    except GroupEvicted as e:  # the job goes on without this group: restart it and it heals
        print(f"diloco worker (group {group}, rank {os.environ.get('RANK', '?')}): left the job: {e}; "
              f"exit {exit_codes.describe(exit_codes.RESTART)}: restart to heal", file=sys.stderr, flush=True)
        return exit_codes.RESTART
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear line and an exit code that says why
        rank = os.environ.get("RANK", "?")
        if user_errors.wants_traceback(e, cfg.train.entry):  # the user's --entry code, a bug, DILOCO_TRACEBACK
            traceback.print_exc()
        code = exit_codes.for_exception(e)
        print(f"diloco worker (group {group}, rank {rank}): {type(e).__name__}: {e}; exit {exit_codes.describe(code)}",
              file=sys.stderr, flush=True)
        return code
    if summary.get("joined_late"):
        print(f"diloco worker (group {group}, rank {summary['rank']}): {summary['reason']}", flush=True)
        return 0
    print(format_worker_line(summary), flush=True)
    if json_path and summary.get("rank") == 0:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)  # as diloco run's --json
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2)
    if summary.get("stopped_by"):  # SIGTERM before the job finished (a deleted pod): restart me, never 0
        print(f"diloco worker (group {group}, rank {summary['rank']}): {summary['stopped_by']}: stopped at step "
              f"{summary['stopped_at_step']} with checkpoint {summary.get('job_checkpoint')}; exit "
              f"{exit_codes.describe(exit_codes.RESTART)}", file=sys.stderr, flush=True)
        return exit_codes.RESTART
    return 0
