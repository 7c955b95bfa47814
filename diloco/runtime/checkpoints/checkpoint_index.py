"""Where job checkpoints are and what they hold, without torch: step folders, the groups'
manifests, the step ``--resume`` names (``find``), its files checked against their checksums, and
the config a resumed job runs (``resume_config``). ``diloco run --resume`` reads all of it before
anything imports torch, so a wrong path is refused at once; ``diloco.runtime.checkpoints.job_checkpoint``
writes the checkpoints (and re-exports these names). The layout is described there.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from diloco.job import auto_choice
from diloco.job.config import Config, ConfigError, iter_fields
from diloco.job.config_parse import from_dict
from diloco.runtime.checkpoints import checkpoint
from diloco.runtime.checkpoints.checkpoint import CheckpointError

FORMAT = "diloco-job-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")

# Settings a resumed job may change: they do not change what is computed (where files go, how
# often to log or checkpoint, addresses, timeouts, lossless wire options). Everything else must
# equal the checkpoint's value.
OPERATIONAL: dict[str, frozenset[str]] = {
    "train": frozenset({"log_every", "progress_every", "log_format", "metrics_port", "save", "checkpoint_every",
                        "checkpoint_dir", "checkpoint_keep", "stop_after"}),
    "transport": frozenset({"host", "data_port", "advertise_address", "timeout_s", "link", "connections", "zstd",
                            "zstd_level", "tls_cert", "tls_key", "tls_ca", "plaintext"}),
    "fault": frozenset({"heartbeat_timeout", "max_restarts", "chaos", "chaos_kinds", "spares"}),
}


def step_path(root: str | Path, step: int) -> Path:
    """The folder of ``step``'s checkpoint under ``root``."""
    return Path(root) / f"step-{step:06d}"


def rank_file(group: int, rank: int) -> str:
    return f"group-{group}-rank-{rank}.pt"


def manifest_file(group: int) -> str:
    return f"group-{group}.json"


def _step_of(folder: Path) -> int | None:
    m = _STEP_DIR.match(folder.name)
    return int(m.group(1)) if m and folder.is_dir() else None


def names_step(path: str | Path) -> bool:
    """Whether ``path`` is one step folder (``DIR/step-NNNNNN``) rather than a root of them."""
    return _step_of(Path(path)) is not None


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step folder under ``root``, oldest first; [] when it is not a folder."""
    if not root.is_dir():
        return []
    found = ((_step_of(d), d) for d in root.iterdir())
    return sorted((s, d) for s, d in found if s is not None)


def read_manifest(folder: str | Path, group: int) -> dict[str, Any] | None:
    """Group ``group``'s manifest in a step folder; None if it was not written (yet)."""
    path = Path(folder) / manifest_file(group)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:  # not written yet, or pruned meanwhile
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise CheckpointError(f"{path}: not a version-{VERSION} {FORMAT} manifest")
    return doc


def _complete_for(folder: Path, group: int) -> dict[str, Any] | None:
    doc = read_manifest(folder, group)
    if doc is None:
        return None
    for name in doc.get("files", {}):
        if not (folder / name).is_file() or not (folder / f"{name}.sha256").is_file():
            return None
    return doc


def complete_groups(folder: str | Path) -> tuple[int, list[int]]:
    """``(groups of the job, groups whose manifest and files are there)`` for one step folder
    (``(0, [])`` when no group finished it)."""
    folder = Path(folder)
    done, groups = [], 0
    for path in folder.glob("group-*.json"):
        m = re.match(r"^group-(\d+)\.json$", path.name)
        if m is None:
            continue
        doc = _complete_for(folder, int(m.group(1)))
        if doc is not None:
            done.append(int(m.group(1)))
            groups = int(doc["groups"])
    return groups, sorted(done)


def _is_complete(folder: Path, group: int | None) -> bool:
    groups, done = complete_groups(folder)
    return group in done if group is not None else (groups > 0 and done == list(range(groups)))


def _complete_folders(root: Path, group: int | None) -> list[tuple[int, Path]]:
    return [(s, d) for s, d in step_folders(root) if _is_complete(d, group)]


def complete_steps(root: str | Path, group: int | None = None) -> list[int]:
    """Steps under ``root`` that every group completed (``group`` given: that group completed)."""
    return [s for s, _ in _complete_folders(Path(root), group)]


def latest_complete_step(root: str | Path) -> int | None:
    """The newest step under ``root`` that every group of the job completed, or None."""
    steps = complete_steps(root)
    return steps[-1] if steps else None


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint to resume from: its root, its step folder, its step and the job's config;
    ``checked``: the files whose checksums were verified (name -> ``checkpoint.fingerprint`` as
    they were)."""

    root: Path
    path: Path
    step: int
    config: Config
    checked: Mapping[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)


def find(path: str | Path, group: int | None = None) -> ResumePoint:
    """The checkpoint ``--resume PATH`` names: PATH is a step folder or a root of them. In a root,
    the newest step every group completed; with ``group``, if no step is complete for the whole
    job (each group keeps its own folder), the newest step that group completed. CheckpointError
    if there is none."""
    p = Path(path)
    if _step_of(p) is not None:
        folder = p
        if not _is_complete(folder, group):
            groups, done = complete_groups(folder)
            raise CheckpointError(f"{folder}: incomplete checkpoint (complete for groups {done} of "
                                  f"{groups or '?'}; a crash while it was written?)")
    else:
        found = _complete_folders(p, None) or (_complete_folders(p, group) if group is not None else [])
        if not found:
            raise CheckpointError(f"no complete job checkpoint under {p} (a step counts once every group "
                                  "wrote its files and its manifest)")
        folder = found[-1][1]
    _, done = complete_groups(folder)
    manifest = folder / manifest_file(group if group is not None else done[0])
    doc = read_manifest(folder, group if group is not None else done[0])
    assert doc is not None
    try:
        cfg = from_dict(doc["config"])
    except (ConfigError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{manifest}: bad config: {e}") from e
    return ResumePoint(folder.parent, folder, int(doc["step"]), cfg)


def verify_step(folder: str | Path) -> None:
    """Check every file every group's manifest lists in a step folder against the manifest and its
    own checksum (reads them all): CheckpointError naming the first bad file."""
    folder = Path(folder)
    _, done = complete_groups(folder)
    for group in done:
        doc = read_manifest(folder, group)
        for name, digest in (doc or {}).get("files", {}).items():
            if checkpoint.verify(folder / name) != digest:
                raise CheckpointError(f"{folder / name}: its checksum differs from the one in {manifest_file(group)}")


def newest_intact_step(root: str | Path, below: int) -> Path | None:
    """The newest step folder under ``root`` before step ``below`` that every group completed and
    whose files all match their manifests (``verify_step``), or None: where to resume instead of
    a newest step that turned out corrupt."""
    for step, folder in reversed(_complete_folders(Path(root), None)):
        if step < below:
            try:
                verify_step(folder)
            except (CheckpointError, OSError):
                continue
            return folder
    return None


def newest_intact_for_rank(point: ResumePoint, group: int, rank: int) -> tuple[ResumePoint | None, list[str]]:
    """From ``point`` (a root's newest step for ``group``) back, the newest step of ``group`` whose
    file for ``rank`` matches its manifest and checksum (reads it; None if none does), and why each
    newer one was skipped."""
    skipped = []
    steps = [s for s in complete_steps(point.root, group) if s <= point.step]
    for step in reversed(steps):
        folder = step_path(point.root, step)
        path = folder / rank_file(group, rank)
        listed = ((read_manifest(folder, group) or {}).get("files") or {}).get(path.name)
        try:
            seen = checkpoint.fingerprint(path)  # before reading: a write meanwhile changes it
            intact = listed is not None and checkpoint.verify(path) == listed
        except (CheckpointError, OSError) as e:
            skipped.append(f"{path}: {e}")
            continue
        if intact:
            return dataclasses.replace(find(folder, group), checked={path.name: seen}), skipped
        skipped.append(f"{path}: not the file its group's manifest lists")
    return None, skipped


def math_differences(saved: Config, now: Config) -> list[str]:
    """Settings that change what is computed and differ: ``--flag: now here, saved in the checkpoint``."""
    out = []
    for section, f in iter_fields(now):
        if f.name in OPERATIONAL.get(section, ()):
            continue
        a, b = getattr(getattr(saved, section), f.name), getattr(getattr(now, section), f.name)
        if a != b:
            out.append(f"{f.metadata['flag']}: {b!r} here, {a!r} in the checkpoint")
    return out


def resume_config(saved: Config, explicit: dict[tuple[str, str], Any], root: str | Path, step: int = 0) -> Config:
    """The config of a job resumed after ``step`` inner steps: the checkpoint's, with the
    operational settings the command line names (``config_parse.explicit_settings``). A named setting
    that changes the math must equal the checkpoint's (ConfigError otherwise: e.g. --steps cannot
    grow, the lr schedule follows it). ``--stop-after`` is not carried over (given, it must lie
    after ``step``); ``--checkpoint-dir`` defaults to ``root``. ``--codec auto`` / ``--h auto``
    (the flags of a job that ran them; its config holds the setting it ran) continue it under
    auto: the checkpoint's setting, following the link from there (the workers check that it ran
    one, ``as_checkpoint_ran``)."""
    codec_auto = explicit.get(("transport", "codec")) == auto_choice.AUTO
    h_auto = explicit.get(("sync", "h")) == auto_choice.AUTO_H
    if codec_auto or h_auto:
        saved = auto_choice.unchoose(saved, codec=codec_auto, h=h_auto)
    cfg = copy.deepcopy(saved)
    cfg.train.stop_after = 0
    cfg.train.checkpoint_dir = str(root)
    flags = {(s, f.name): f.metadata["flag"] for s, f in iter_fields(saved)}
    conflicts = []
    for (section, name), value in explicit.items():
        if name in OPERATIONAL.get(section, ()):
            setattr(getattr(cfg, section), name, value)
        elif getattr(getattr(saved, section), name) != value:
            old = getattr(getattr(saved, section), name)
            conflicts.append(f"{flags[(section, name)]}: {value!r} asked, {old!r} in the checkpoint")
    if cfg.train.stop_after and cfg.train.stop_after <= step:
        conflicts.append(f"--stop-after: {cfg.train.stop_after} asked, but the checkpoint is at step {step}")
    if conflicts:
        raise ConfigError(
            "--resume continues the checkpoint's job; these settings change what it computes and must match "
            "it (leave them out to use the checkpoint's):\n  " + "\n  ".join(conflicts))
    return cfg.validate()
