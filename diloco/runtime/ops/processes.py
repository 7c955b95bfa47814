"""The process trees ``diloco run`` starts: marked, found, and ended for certain (Linux ``/proc``).

Every process a run starts carries ``DILOCO_RUN_ID=<id>`` in its environment (and its children
inherit it), so what a run left behind is found by that marker, whatever it was reparented to.
``end_trees`` sends SIGTERM to every process of the trees, SIGKILL to what is left after a grace
period (at once when ``hurry`` is set: a second Ctrl-C), and returns only once every one is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterable

RUN_ID_ENV = "DILOCO_RUN_ID"


def _stat_fields(pid: int | str) -> list[str] | None:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # the process ended while we looked
        return None


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(entry.name)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def children(pid: int) -> list[int]:
    """PIDs of ``pid``'s own children (Linux /proc; [] without it), sorted."""
    return sorted(_children_by_parent().get(pid, []))


def descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (Linux /proc), children first found first."""
    children = _children_by_parent()
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie has ended; it only waits to be reaped)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):  # gone already (or its pid reused by another user)
            pass


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and everything below it, at once (as a machine failure would); reaps it."""
    _signal([proc.pid, *descendants(proc.pid)], signal.SIGKILL)
    proc.wait()


def freeze_tree(proc: subprocess.Popen, frozen: bool) -> None:
    """SIGSTOP (``frozen``) or SIGCONT a process and everything below it (a hung host, then one
    that goes on); the parent first on stopping, so that it starts nothing meanwhile."""
    tree = [proc.pid, *descendants(proc.pid)]
    _signal(tree if frozen else reversed(tree), signal.SIGSTOP if frozen else signal.SIGCONT)


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text`` (e.g. a run folder)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # ended while we looked
                continue
            if text in cmdline and alive(int(entry.name)):
                out.append(int(entry.name))
    return out


def processes_marked(run_id: str) -> list[int]:
    """PIDs of live processes that carry ``DILOCO_RUN_ID=run_id`` in their environment."""
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:  # ended while we looked, or not ours to read
                continue
            if needle in environ.split(b"\0") and alive(int(entry.name)):
                out.append(int(entry.name))
    return out


def end_trees(procs: list[subprocess.Popen], *, grace_s: float = 5.0, run_id: str | None = None,
              hurry: threading.Event | None = None) -> list[int]:
    """End every process of ``procs``' trees (and any process marked with ``run_id``): SIGTERM,
    then SIGKILL after ``grace_s`` or as soon as ``hurry`` is set; reaps ``procs``. Returns only
    when every one of them is gone (or, after a SIGKILL that could not end them in 10 s, the
    PIDs still there)."""
    hurry = hurry or threading.Event()

    def everyone() -> set[int]:
        pids = {p.pid for p in procs if p.poll() is None}
        for p in procs:
            pids.update(descendants(p.pid))
        if run_id is not None:
            pids.update(processes_marked(run_id))
        return {pid for pid in pids if alive(pid)}

    pids = everyone()
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline and not hurry.is_set():
        time.sleep(0.05)
        for p in procs:
            p.poll()  # reap what ended, so it does not count as alive
        pids = {pid for pid in pids | everyone() if alive(pid)}
    killed_at = time.monotonic()
    while pids and time.monotonic() - killed_at < 10.0:
        _signal(pids, signal.SIGKILL)
        time.sleep(0.02)
        for p in procs:
            p.poll()
        pids = {pid for pid in pids | everyone() if alive(pid)}
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(1.0)
            except subprocess.TimeoutExpired:  # unkillable (D state): reported to the caller
                pids.add(p.pid)
    return sorted(pids)
