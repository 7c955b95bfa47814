"""``kill -USR1 PID``: a ``diloco`` process writes every thread's Python stack to its stderr, and runs on.

For the rank that says nothing: ``kubectl exec POD -- kill -USR1 1`` (PID 1 of a worker pod is
``diloco torchrun``, which passes the signal on to each of its workers), then ``kubectl logs POD``.
With ``--log-format json`` each line of the dump is a record of its own (``diloco.runtime.ops.logpump``
turns what fd 2 receives into records). Standard library only: no py-spy in the image.

    diloco worker, coordinator, run  -> ``install()``: the dump (``faulthandler``, written from C at
                                        once, even while the main thread blocks in native code)
    diloco torchrun (the agent)      -> ``forward_to_children()``: the signal, to its child processes
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
from pathlib import Path

from diloco.runtime.ops import processes

log = logging.getLogger(__name__)

#: the signal that asks for the dump
DUMP_SIGNAL = signal.SIGUSR1
#: where the dump goes: the process's fd 2 (its log), whatever ``sys.stderr`` is at the time (a
#: caller's replacement, such as pytest's capture, may have no file descriptor at all)
STDERR_FD = 2


def install() -> None:
    """On ``DUMP_SIGNAL``, write every thread's stack to fd 2 (this process goes on)."""
    faulthandler.register(DUMP_SIGNAL, file=STDERR_FD, all_threads=True, chain=False)


def child_pids(pid: int | None = None) -> list[int]:
    """The PIDs of ``pid``'s children (default: this process), sorted ([] where /proc lacks them)."""
    return processes.children(os.getpid() if pid is None else pid)


def _is_log_pump(pid: int) -> bool:
    """Whether ``pid`` is a log pump (``diloco.runtime.ops.logpump``: it has no stacks to dump)."""
    try:
        return b"logpump.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def forward_to_children() -> None:
    """On ``DUMP_SIGNAL``, send it on to this process's children (torchrun's workers, not its log
    pump) and log that."""

    def forward(signum: int, _frame) -> None:
        children = [pid for pid in child_pids() if not _is_log_pump(pid)]
        for child in children:
            try:
                os.kill(child, signum)
            except ProcessLookupError:  # it ended meanwhile
                pass
        log.warning("SIGUSR1: asked the workers (PIDs %s) for their threads' stacks", children or "none")

    signal.signal(DUMP_SIGNAL, forward)
