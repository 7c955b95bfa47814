"""What can be checked before any process starts: every path a command will write, every port it
will bind, the configuration, and the data or ``--entry`` it will train.

A path is checked by writing and removing a probe file in it (a folder) or beside it (a file),
at the nearest folder that exists: nothing is created that the run would not create. A port is
checked by binding it. The errors are ``PreflightError`` (a ``ConfigError``: exit code 2), and
each names the flag, the path or port, and the cause.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from diloco.job.config import Config, ConfigError

if TYPE_CHECKING:
    from diloco.demo.data import Corpus

PROBE_NAME = ".diloco-write-probe-{pid}-{token}"


class PreflightError(ConfigError):
    """A path that cannot be written or a port that cannot be bound; the message says which and why."""


def _why(e: OSError) -> str:
    return {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on the device",
            errno.ENOTDIR: "not a folder", errno.EISDIR: "is a folder"}.get(e.errno, e.strerror or str(e))


def _probe_folder(flag: str, shown: Path, folder: Path) -> None:
    """Write and remove a probe file in ``folder`` (an existing folder)."""
    probe = folder / PROBE_NAME.format(pid=os.getpid(), token=secrets.token_hex(4))
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PreflightError(f"{flag} {shown}: cannot write in {folder}: {_why(e)}") from None


def _existing_ancestor(flag: str, shown: Path, path: Path) -> Path:
    """The nearest existing folder at or above ``path``; an error if that ancestor is a file."""
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                what = "is a regular file" if parent.is_file() else "exists and is not a folder"
                raise PreflightError(f"{flag} {shown}: {parent} {what}, so no folder can be made under it")
            return parent
    return Path(os.sep)


def check_writable_folder(flag: str, path: str | os.PathLike[str]) -> None:
    """``path`` is, or can be made as, a folder this process may write in."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise PreflightError(f"{flag} {path}: exists and is not a folder")
    _probe_folder(flag, Path(path), _existing_ancestor(flag, Path(path), p.absolute()))


def check_writable_file(flag: str, path: str | os.PathLike[str]) -> None:
    """``path`` can be written (created or replaced) as a file by this process."""
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        raise PreflightError(f"{flag} {path}: is a folder; give a file name")
    if str(path).endswith(os.sep):
        raise PreflightError(f"{flag} {path}: ends with {os.sep}; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise PreflightError(f"{flag} {path}: the file exists and cannot be written (permission denied)")
    _probe_folder(flag, Path(path), _existing_ancestor(flag, Path(path), p.parent))


def check_ports(flag: str, host: str, ports: Iterable[int]) -> None:
    """Every port in ``ports`` can be bound on ``host`` now (0 is skipped: any free port)."""
    for port in ports:
        if not port:
            continue
        if not 0 < port < 65536:
            raise PreflightError(f"{flag}: port {port} is outside 1-65535")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                cause = "already in use" if e.errno == errno.EADDRINUSE else _why(e)
                raise PreflightError(f"{flag}: cannot bind {host}:{port}: {cause}") from None


def check_worker_paths(cfg: Config, *, group: int, rank: int, local_rank: int, json_path: str | None) -> None:
    """What ``diloco worker`` (this rank of ``group``) will write and bind."""
    t = cfg.train
    if t.save and group == 0 and rank == 0:
        check_writable_file("--save", t.save)
    if json_path and rank == 0:
        check_writable_file("--json", json_path)
    if t.checkpoint_dir:
        check_writable_folder("--checkpoint-dir", t.checkpoint_dir)
    if t.metrics_port:
        check_ports("--metrics-port", cfg.transport.host, [t.metrics_port + local_rank])


def check_run_paths(cfg: Config, *, run_dir: str | None, json_path: str | None = None) -> None:
    """What ``diloco run`` will write and bind: its run folder (logs, the resolved config), the
    final model, the checkpoints, the summary, every rank's and the coordinator's metrics port,
    and every rank's data port (``--data-port``: one per rank of every group)."""
    if run_dir:
        check_writable_folder("--run-dir", run_dir)
    if cfg.train.checkpoint_dir:
        check_writable_folder("--checkpoint-dir", cfg.train.checkpoint_dir)
    if cfg.train.save:
        check_writable_file("--save", cfg.train.save)
    if json_path:
        check_writable_file("--json", json_path)
    ranks = sum(cfg.topology.sizes())
    metrics = range(cfg.train.metrics_port, cfg.train.metrics_port + ranks + 1) if cfg.train.metrics_port else range(0)
    # the groups share this host: group g's ranks listen on --data-port + the ranks before it (launcher.data_port_args)
    data = range(cfg.transport.data_port, cfg.transport.data_port + ranks) if cfg.transport.data_port else range(0)
    if set(metrics) & set(data):
        raise PreflightError(f"--data-port {cfg.transport.data_port} (ports {data.start}-{data.stop - 1}, one per rank) "
                             f"overlaps --metrics-port {cfg.train.metrics_port} (ports {metrics.start}-{metrics.stop - 1}: "
                             "one per rank and the coordinator's)")
    check_ports("--metrics-port", cfg.transport.host, metrics)
    check_ports(f"--data-port (ports {data.start}-{data.stop - 1}: one per rank of every group)"
                if data else "--data-port", cfg.transport.host, data)


def check_workload(cfg: Config) -> Corpus | None:
    """The configuration, and the demo's corpus (returned) or that a user's ``--entry`` imports and
    is callable. (The only check here that imports torch, so the paths and ports are refused without it.)"""
    from diloco.demo import data as data_mod
    from diloco.job.task import load_entry, parse_entry_args

    cfg.validate()
    if cfg.train.entry:
        parse_entry_args(cfg.train.entry_args)
        load_entry(cfg.train.entry)
        return None
    corpus = data_mod.load_corpus(cfg.data.path or None)
    train, val = data_mod.split(corpus, cfg.data.val_fraction)
    data_mod.check_feedable(len(train), cfg.topology.groups, cfg.model.block_size, what="training")
    data_mod.check_feedable(len(val), 1, cfg.model.block_size, what="validation")
    if corpus.vocab_size > 65536:
        raise data_mod.DataError(f"vocabulary of {corpus.vocab_size} tokens is too large")
    return corpus
