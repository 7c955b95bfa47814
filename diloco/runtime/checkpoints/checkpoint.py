"""Checkpoints of the global (outer) model: written atomically, read without pickle.

A checkpoint is a ``torch.save`` of a dict of tensors and plain values, loaded with
``torch.load(weights_only=True)``, so reading one never runs code from the file. Writes go to a
temporary file in the same folder, are fsynced, then renamed over the target, so a crash leaves
either the old checkpoint or the new one. A SHA-256 of the file's bytes is stored beside it
(``PATH.sha256``) and checked on load: a truncated or altered file is a ``CheckpointError``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that write or read tensors: checksums and manifests need none,
# so ``diloco run --resume`` refuses a bad path before torch loads (seconds on a CUDA host)


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or not what the caller expects."""


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically: a crash leaves the old file or the new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(target, lambda f: f.write(text.encode()))
    return target


def recorded_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 (hex) that ``save`` recorded beside ``path``; CheckpointError if there is none."""
    sidecar = Path(path).with_name(Path(path).name + ".sha256")
    if not Path(path).is_file() or not sidecar.is_file():
        raise CheckpointError(f"{path}: missing, or its checksum file {sidecar.name} is")
    return sidecar.read_text().strip()


def verify(path: str | os.PathLike[str]) -> str:
    """Check ``path`` against the SHA-256 recorded beside it; returns it (CheckpointError if not)."""
    expected = recorded_digest(path)
    if _digest(Path(path)) != expected:
        raise CheckpointError(f"{path}: contents do not match {Path(path).name}.sha256 (truncated or altered)")
    return expected


def save(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors, numbers, strings, lists, dicts) atomically; returns the path."""
    import torch

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(target, lambda f: torch.save(state, f))
    digest = _digest(target)
    _atomic_write(target.with_name(target.name + ".sha256"), lambda f: f.write(f"{digest}\n".encode()))
    return target


def fingerprint(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    """(inode, size in bytes, modification time in ns) of a file: taken before its checksum is
    verified, it tells ``load`` whether the file is still the one verified."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def load(path: str | os.PathLike[str], map_location: str | torch.device = "cpu", *,
         verified: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """Read a checkpoint written by ``save``; verifies its checksum, unless the caller verified it
    and the file's ``fingerprint`` is still ``verified`` (not written since: it is not read twice);
    never unpickles objects."""
    import torch

    target = Path(path)
    if not target.is_file():
        raise CheckpointError(f"checkpoint not found: {target}")
    sidecar = target.with_name(target.name + ".sha256")
    if not sidecar.is_file():
        raise CheckpointError(f"{target}: checksum file {sidecar.name} is missing")
    expected = sidecar.read_text().strip()
    if (verified is None or fingerprint(target) != verified) and _digest(target) != expected:
        raise CheckpointError(f"{target}: contents do not match {sidecar.name} (truncated or altered)")
    try:
        state = torch.load(target, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to parse is a corrupt checkpoint
        raise CheckpointError(f"{target}: cannot be read as a weights-only checkpoint: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{target}: expected a dict at the top level, got {type(state).__name__}")
    return state


def load_global_model(path: str | os.PathLike[str], model: torch.nn.Module) -> dict[str, Any]:
    """Load the global parameters of a checkpoint into ``model``; returns the checkpoint."""
    import torch

    state = load(path)
    params = state.get("global")
    if not isinstance(params, dict):
        raise CheckpointError(f"{path}: no 'global' parameters in the checkpoint")
    names = dict(model.named_parameters())
    missing = sorted(set(names) - set(params))
    unexpected = sorted(set(params) - set(names))
    if missing or unexpected:
        raise CheckpointError(f"{path}: parameters do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    with torch.no_grad():
        for n, p in names.items():
            if params[n].shape != p.shape:
                raise CheckpointError(f"{path}: {n} has shape {tuple(params[n].shape)}, model {tuple(p.shape)}")
            p.copy_(params[n])
    return state
