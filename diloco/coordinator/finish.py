"""The end of a job as ``diloco coordinator`` sees it: wait for every group's summary, then print
the job's summary and write it as JSON (torch-free)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Collection
from typing import Any, TextIO

from .report import format_job_summary, job_summary
from .server import CoordinatorServer

POLL_S = 0.25  # how often the wait checks the stop event (seconds): SIGTERM's worst-case delay
FINISH_GRACE_S = 2.0  # longest stop() waits for calls in flight, e.g. the last summary's Ack


def wait_for_job(server: CoordinatorServer, stop: threading.Event,
                 poll_s: float = POLL_S) -> dict[int, dict[str, Any]] | None:
    """``{group: summary}`` once every expected group ended (``rounds.job_finished``), or None once ``stop`` is set
    (checked every ``poll_s`` seconds), the server stopped, no group holds the job's state any
    more (``server.state_lost``: the caller restarts the coordinator), or the job halted
    (``server.halted``: the caller stops with exit 2)."""
    while not stop.is_set():
        summaries = server.wait_finished(timeout_s=poll_s)
        if summaries is not None:
            return summaries
        if server.stopped or getattr(server, "state_lost", None) or getattr(server, "halted", None):
            return None
    return None


def report_job(summaries: dict[int, dict[str, Any]], json_path: str | None, *, joined_late: Collection[int],
               out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the job's summary to ``out`` and each problem (e.g. diverged parameters) to ``err``
    (default: ``sys.stdout`` and ``sys.stderr`` as they are when it is called, so a JSON log setup
    made after this module was imported turns them into records), write the summary as JSON to
    ``json_path`` if given; returns 0 if the job ended cleanly, else 1. ``joined_late``: the groups
    the coordinator told the job had finished before they could heal (``server.joined_late``)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    job = job_summary(summaries, joined_late)
    print(format_job_summary(job), file=out, flush=True)
    for problem in job["problems"]:
        print(f"diloco coordinator: {problem}", file=err, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(job, f, indent=2)
            f.write("\n")
    return 0 if job["ok"] else 1
