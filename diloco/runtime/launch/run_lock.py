"""One ``diloco run`` per folder: a lock on its ``--run-dir`` (and ``--checkpoint-dir``).

Two runs sharing a run folder would write over each other's logs and config and share one
checkpoint folder. ``hold`` takes an exclusive ``fcntl.flock`` on ``FOLDER/.diloco-run.lock``,
which holds the holder's PID; a second run is refused (``RunDirBusy``, a ``ConfigError``: exit
code 2) with that PID. The kernel drops the lock when the holder exits, however it exits, so a
killed run leaves nothing to clean up.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from diloco.job.config import ConfigError

LOCK_NAME = ".diloco-run.lock"


class RunDirBusy(ConfigError):
    """Another live ``diloco run`` holds the folder."""


def hold(flag: str, folder: str | os.PathLike[str]) -> IO[str]:
    """Lock ``folder`` (made if missing) for this process; returns the open lock file, which must
    stay open (and referenced) as long as the run lasts. ``RunDirBusy`` naming the holder's PID."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    lock_path = path / LOCK_NAME
    f = open(lock_path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunDirBusy(f"{flag} {folder}: in use by another diloco run (pid {holder}, lock {lock_path}); give "
                         f"another {flag}, or stop that run first") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def remove_if_unused(folders: list[str]) -> None:
    """Remove each of ``folders`` (innermost first) that holds nothing but its lock file: the
    folders a run made for its locks, when it stops with an error before it wrote anything."""
    for folder in sorted(folders, key=lambda f: len(Path(f).resolve().parts), reverse=True):
        path = Path(folder)
        try:
            if path.is_dir() and {p.name for p in path.iterdir()} <= {LOCK_NAME}:
                (path / LOCK_NAME).unlink(missing_ok=True)
                path.rmdir()
        except OSError:
            pass
