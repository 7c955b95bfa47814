"""Job checkpoints: every rank of every group saves its whole state at the same inner step.

``--checkpoint-every N``, ``--stop-after N`` and SIGTERM make every rank write, after the same
inner step, one file with everything needed to continue bit-identically (``diloco.runtime.checkpoints.rank_state``);
``diloco run --resume DIR`` continues from the newest step that every group completed. Layout,
one folder per step::

    DIR/step-000040/group-0-rank-0.pt          rank 0 of group 0 (torch.save; read weights_only)
    DIR/step-000040/group-0-rank-0.pt.sha256   its SHA-256 (diloco.runtime.checkpoints.checkpoint.save)
    DIR/step-000040/group-0.json               group 0's manifest: written last, atomically
    DIR/step-000040/group-1-rank-0.pt ...

A step is *complete for a group* once that group's manifest exists (rank 0 writes it after every
rank of the group wrote its file, listing the files and their SHA-256), and *complete* once every
group's manifest exists. A crash mid-write leaves a step without some manifest; resuming ignores
it. Files are read with ``torch.load(weights_only=True)`` after their checksum is verified.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diloco.job import auto_choice
from diloco.job.config import Config, ConfigError
from diloco.job.config_parse import from_dict
from diloco.runtime.checkpoints import checkpoint, rank_state
from diloco.runtime.checkpoints.checkpoint import CheckpointError
from diloco.runtime.checkpoints.checkpoint_index import (FORMAT, OPERATIONAL, VERSION, ResumePoint,  # noqa: F401
                                             complete_groups, complete_steps, find, latest_complete_step,
                                             manifest_file, math_differences, names_step, newest_intact_for_rank,
                                             newest_intact_step, rank_file,
                                             read_manifest, resume_config, step_folders, step_path,
                                             verify_step)

# the index's names (checkpoint_index, torch-free) are re-exported: callers find every name here


def write_rank(root: str | Path, step: int, group: int, rank: int, state: dict[str, Any]) -> Path:
    """Write one rank's state (atomically, with its SHA-256); returns the file."""
    return checkpoint.save(step_path(root, step) / rank_file(group, rank), state)


def write_manifest(root: str | Path, step: int, group: int, ranks: int, cfg: Config, **extra: Any) -> Path:
    """Group ``group``'s manifest for ``step``, after all its ``ranks`` wrote their files; the step
    is complete for the group once this file exists. ``extra``: JSON values to record."""
    folder = step_path(root, step)
    files = {rank_file(group, r): checkpoint.recorded_digest(folder / rank_file(group, r)) for r in range(ranks)}
    doc = {"format": FORMAT, "version": VERSION, "step": step, "group": group, "groups": cfg.topology.groups,
           "ranks": ranks, "files": files, **extra, "config": cfg.to_dict()}
    return checkpoint.atomic_write_text(folder / manifest_file(group), json.dumps(doc, indent=1) + "\n")


def prune(root: str | Path, group: int, keep: int) -> list[int]:
    """Delete ``group``'s files of every step older than its ``keep`` newest complete ones (its
    manifest first, so a half-deleted step never looks complete); empty folders go too. Other
    groups' files are left alone. Returns the steps touched."""
    if keep <= 0:
        return []
    folders = step_folders(Path(root))
    mine = [s for s, d in folders if (d / manifest_file(group)).is_file()]
    if len(mine) <= keep:
        return []
    oldest_kept = mine[-keep]
    touched = []
    prefixes = (f"group-{group}-rank-", f".group-{group}-rank-", f".{manifest_file(group)}.")
    for step, folder in folders:
        if step >= oldest_kept:
            break
        (folder / manifest_file(group)).unlink(missing_ok=True)
        try:
            files = list(folder.iterdir())
        except FileNotFoundError:  # another group, pruning too, removed its last files and the folder
            continue
        for f in files:
            if f.name.startswith(prefixes):
                f.unlink(missing_ok=True)
        try:
            folder.rmdir()
        except OSError:  # other groups' files are still there
            pass
        touched.append(step)
    return touched


@dataclass
class RankCheckpoint:
    """One rank's state read from ``path`` (checksum verified, config checked)."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def load_rank(folder: str | Path, cfg: Config, group: int, rank: int, *,
              verified: tuple[int, int, int] | None = None) -> RankCheckpoint:
    """Read and check this rank's file of a step folder: the group's manifest lists it with the
    same SHA-256, the file matches it (not read for it again when it is still the file the caller
    verified, ``verified``: its fingerprint then, ``newest_intact_for_rank``), and it was saved by
    this group and rank of a job with the same math (``math_differences``). CheckpointError naming
    the file otherwise."""
    folder = Path(folder)
    doc = read_manifest(folder, group)
    if doc is None:
        raise CheckpointError(f"{folder}: no manifest {manifest_file(group)}: group {group}'s checkpoint of "
                              "this step is incomplete")
    path = folder / rank_file(group, rank)
    expected = doc.get("files", {}).get(path.name)
    if expected is None:
        raise CheckpointError(f"{folder / manifest_file(group)} lists no {path.name} (the group had "
                              f"{doc.get('ranks')} ranks, this job gives it {cfg.topology.sizes()[group]})")
    if checkpoint.recorded_digest(path) != expected:
        raise CheckpointError(f"{path}: its checksum differs from the one in {manifest_file(group)}")
    state = checkpoint.load(path, verified=verified)
    if state.get("format") != rank_state.FORMAT or state.get("version") != rank_state.VERSION:
        raise CheckpointError(f"{path}: not a version-{rank_state.VERSION} {rank_state.FORMAT} file")
    if (state.get("group"), state.get("rank"), state.get("step")) != (group, rank, doc.get("step")):
        raise CheckpointError(f"{path}: holds group {state.get('group')} rank {state.get('rank')} step "
                              f"{state.get('step')}, expected group {group} rank {rank} step {doc.get('step')}")
    try:
        saved = from_dict(state["config"])
    except (ConfigError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: bad config: {e}") from e
    ran = as_checkpoint_ran(cfg, state, path)  # the config to compare: the setting it ran, with auto
    diffs = math_differences(saved, ran)
    if diffs:
        raise CheckpointError(f"{path}: saved by a different job:\n  " + "\n  ".join(diffs))
    return RankCheckpoint(path, state)


def auto_row(state: dict) -> str | None:
    """The ``--codec/--h auto`` setting a rank checkpoint's engine ran (its schedule's state), or
    None for a job of fixed flags."""
    engine = state.get("engine")
    row = (engine.get("schedule") or {}).get("row") if isinstance(engine, dict) else None
    return row if isinstance(row, str) else None


def as_checkpoint_ran(cfg: Config, state: dict, path: Path) -> Config:
    """``cfg``, or with ``--codec auto`` / ``--h auto`` the config of the setting the checkpoint
    ran (its engine state names it; its config holds it as fixed flags), to compare the rest
    with. CheckpointError for a checkpoint of fixed flags, or of a setting this table lacks."""
    codec_auto, h_auto = auto_choice.is_auto(cfg)
    if not (codec_auto or h_auto):
        return cfg
    row = auto_row(state)
    if row is None:
        raise CheckpointError(f"{path}: saved by a job of fixed flags, not --codec/--h auto: resume it with the flags "
                              "its config holds (diloco run --resume DIR takes them from the checkpoint)")
    setting = auto_choice.load_table().named(row)
    if setting is None:
        raise CheckpointError(f"{path}: runs the auto setting {row!r}, which this version's auto table does not hold")
    return auto_choice.apply_choice(cfg, setting).validate()


@dataclass(frozen=True)
class CheckpointOptions:
    """What ``JobCheckpointer`` reads of a job's settings, built by the worker from its config."""

    root: str  # --checkpoint-dir ("": none, which a checkpointer refuses)
    every: int  # --checkpoint-every (0: no periodic checkpoints)
    stop_after: int  # --stop-after (0: none)
    keep: int  # --checkpoint-keep: complete steps kept
    steps: int  # --steps: none is written after the last
    config: Config  # the job's config as it runs: what each checkpoint records (and a resume compares)

    @classmethod
    def of(cls, cfg: Config) -> CheckpointOptions:
        """The checkpoint options of the job ``cfg`` (as it runs: after ``--codec/--h auto`` chose)."""
        t = cfg.train
        return cls(root=t.checkpoint_dir, every=t.checkpoint_every, stop_after=t.stop_after, keep=t.checkpoint_keep,
                   steps=t.steps, config=cfg)


class JobCheckpointer:
    """The worker's checkpoints: when to write one, when to stop, and the writing.

    After inner step ``s`` a checkpoint is written when ``s`` is a multiple of
    ``checkpoint_every``, when ``s == stop_after``, or when the job agreed to stop (the
    connection's ``stop_requested``, set on every group at the same step). The worker then stops
    at ``stop_after``, on an agreed stop, or — after ``request_stop()`` (SIGTERM) — at the next
    periodic checkpoint. Nothing is written after the last step (``--save`` has the final model).
    """

    def __init__(self, opts: CheckpointOptions, *, group: int, rank: int, group_size: int, engine: Any,
                 model: torch.nn.Module, inner: torch.optim.Optimizer, task: Any, link: Any,
                 device: torch.device | None = None, start_step: int = 0, initial_eval_loss: float = math.nan,
                 healed: bool = False) -> None:
        if not opts.root:
            raise ConfigError("--checkpoint-every / --stop-after need --checkpoint-dir (diloco run sets one)")
        if opts.stop_after and (opts.stop_after < start_step or opts.stop_after == start_step and not healed):
            raise ConfigError(f"--stop-after {opts.stop_after} is not after the checkpoint's step {start_step}")
        self.start_step, self.healed = start_step, healed
        self.cfg, self.root = opts.config, Path(opts.root)
        self.every, self.stop_after, self.keep = opts.every, opts.stop_after, opts.keep
        self.steps, self.group, self.rank, self.group_size = opts.steps, group, rank, group_size
        self.engine, self.model, self.inner, self.task = engine, model, inner, task
        self.link, self.device = link, device
        self.initial_eval_loss = initial_eval_loss
        self.stop_signalled = False  # set by request_stop (the worker's SIGTERM handler)
        self.stop_timer: threading.Timer | None = None  # the SIGTERM's --stop-grace deadline (train_loop.on_sigterm)
        self.stopped = False  # the rank left the training loop at a checkpoint
        self.last: Path | None = None  # the newest step folder written

    def catch_up(self, *, loss_ema: float | None) -> bool:
        """Before the first inner step: a group that healed into the job (``healed``) does what
        the others do after ``start_step`` (their donor served its state from inside that step's
        exchange, so they have yet to write that step's checkpoint or stop at it); any other group
        stops at ``start_step``, with a checkpoint there, if the job agreed to stop in the exchange
        that started it (the initial-parameter agreement: a stop asked during start-up). True if
        the worker stops now."""
        if self.healed:
            return self.after_step(self.start_step, loss_ema=loss_ema)
        if not getattr(self.link, "stop_requested", False) or self.start_step >= self.steps:
            return False
        self.save(self.start_step, loss_ema=loss_ema)
        return True

    def request_stop(self) -> None:
        """Stop at the next step where a checkpoint is written (``checkpoint_every`` or an agreed stop)."""
        self.stop_signalled = True

    def after_step(self, step: int, *, loss_ema: float | None) -> bool:
        """Write a checkpoint after ``step`` inner steps if one is due; True if the worker stops now."""
        if step >= self.steps:
            return False
        agreed = bool(getattr(self.link, "stop_requested", False))
        periodic = bool(self.every) and step % self.every == 0
        stop = agreed or step == self.stop_after or (self.stop_signalled and periodic)
        if stop or periodic:
            self.save(step, loss_ema=loss_ema)
        return stop

    def running_config(self) -> Config:
        """The config the job runs at this step. With ``--codec auto`` / ``--h auto`` the setting
        auto runs now, which may differ from the one chosen at start (codec and H follow the
        link): a resume then continues with it, as fixed flags, and the engine state it loads
        (error-feedback residuals above all) is the state of that setting."""
        schedule = getattr(self.link, "auto_schedule", None)
        if schedule is None:
            return self.cfg
        return auto_choice.apply_choice(self.cfg, schedule.choice.setting).validate()

    def save(self, step: int, *, loss_ema: float | None) -> Path:
        """Write this rank's file and, on rank 0, the group's manifest; prune old steps."""
        # a barrier across groups first: every group finished writing its previous checkpoint,
        # so with keep >= 2 the newest complete step always survives pruning
        rank_state.agree_on_step(self.link, step, tag=f"checkpoint/{step}")
        positions = getattr(getattr(self.link, "averager", None), "positions", None)
        cfg = self.running_config()
        state = rank_state.capture(step=step, cfg=cfg, engine=self.engine, model=self.model, inner=self.inner,
                                   task=self.task, loss_ema=loss_ema, initial_eval_loss=self.initial_eval_loss,
                                   group=self.group, rank=self.rank, device=self.device,
                                   periods=getattr(self.link, "periods", ()),
                                   data_positions=None if positions is None else positions.state)
        write_rank(self.root, step, self.group, self.rank, state)
        if self.group_size > 1 and dist.is_available() and dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            write_manifest(self.root, step, self.group, self.group_size, cfg,
                           mode=self.engine.mode, param_hash=self.engine.global_hash())
            prune(self.root, self.group, self.keep)
        self.last = step_path(self.root, step)
        return self.last
