"""How ``diloco run`` stops when asked (SIGINT, SIGTERM): every group checkpoints at its next
exchange and stops, within a deadline (``--stop-timeout``, or three rounds at the pace so far);
a second signal, or the deadline, ends every process at once; and its words when it could not.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from diloco.coordinator import CoordinatorServer
from diloco.runtime.checkpoints import job_checkpoint

STOP_TIMEOUT_BOUNDS_S = (30.0, 300.0)  # the automatic graceful-stop deadline: 3 rounds, within these


def overdue_message(stop: "GracefulStop", root: str, out_dir: Path) -> str:
    """``diloco run``'s words when a graceful stop passed its deadline: the complete checkpoint the
    groups wrote after the signal (and how to resume from it), or that they wrote none."""
    newest = job_checkpoint.latest_complete_step(root) if root else None
    late = f"the groups did not stop within {stop.timeout_s:.0f} s of the {stop.signal_name} (--stop-timeout)"
    if newest is not None and newest != stop.checkpoint_before:
        return (f"{late}, after they wrote a complete checkpoint at step {newest}; stopped every process (logs in "
                f"{out_dir})\nresume: diloco run --resume {root}")
    how = (f"resume from the older checkpoint (step {newest}): diloco run --resume {root}" if newest is not None
           else "no complete checkpoint to resume from: start again")
    return f"{late} and did not checkpoint; stopped every process (logs in {out_dir})\n{how}"


class GracefulStop:
    """``diloco run``'s answer to SIGINT and SIGTERM (main thread only; elsewhere it does nothing).

    The first asks every group, through the coordinator, to checkpoint at its next exchange and
    stop, and starts the deadline ``timeout_s()``; a second raises KeyboardInterrupt (the run then
    ends every process at once). Once ``ending`` is set, a signal only sets ``hurry`` (SIGKILL
    without waiting out the grace period): nothing can interrupt the ending of the processes.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, server: CoordinatorServer, timeout_s: Callable[[], float],
                 trained: Callable[[], bool] = lambda: True,
                 newest_checkpoint: Callable[[], int | None] = lambda: None) -> None:
        self.server, self._timeout = server, timeout_s
        self._trained, self._newest_checkpoint = trained, newest_checkpoint
        self.signal_name: str | None = None  # the first signal's (SIGINT, SIGTERM)
        self.checkpoint_before: int | None = None  # the newest complete checkpoint when it came
        self.ending, self.hurry = threading.Event(), threading.Event()
        self.deadline: float | None = None
        self.timeout_s = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.ending.is_set():
            self.hurry.set()
            return
        if self.deadline is None:
            self.signal_name = name
            if not self._trained():  # nothing to lose: no checkpoint is needed to start again
                logging.getLogger("diloco.run").warning(
                    "%s during start-up: nothing was trained yet, so no checkpoint is needed; stopping now", name)
                raise KeyboardInterrupt
            self.checkpoint_before = self._newest_checkpoint()
            self.timeout_s = self._timeout()
            self.deadline = time.monotonic() + self.timeout_s
            logging.getLogger("diloco.run").warning(
                "%s: every group checkpoints at its next exchange and stops (within %.0f s; %s again: stop now)",
                name, self.timeout_s, "Ctrl-C" if signum == signal.SIGINT else name)
            self.server.request_stop(f"{name} to diloco run")
            return
        raise KeyboardInterrupt


def trained_since(snapshot: dict, start_step: int) -> bool:
    """True once any group reported an inner step past ``start_step`` (the job's start, or the
    step it resumed from): before that a stop loses nothing."""
    return any(int(p.get("step", 0)) > start_step for p in snapshot.get("progress", {}).values())


def auto_stop_timeout(snapshot: dict, elapsed_s: float) -> float:
    """The graceful-stop deadline when none is given: three rounds at the pace so far (start-up
    included), within ``STOP_TIMEOUT_BOUNDS_S``."""
    rounds = int(snapshot.get("rounds_state", {}).get("committed_training", 0))
    per_round = elapsed_s / max(rounds, 1)
    low, high = STOP_TIMEOUT_BOUNDS_S
    return min(max(3.0 * per_round, low), high)
