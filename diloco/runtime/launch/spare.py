"""Warm spares (``diloco run --spares N``): processes started ahead, with python, torch and the
worker already imported, that become a failed group of one rank the moment it is restarted.

Starting a group is seconds of imports (torchrun's agent and the worker each load torch; DDP's
constructor loads ``torch._dynamo``; the task's module its own packages, the demo its corpus's),
longer on a host busy with the other groups; during them the group trains nothing, which is most
of what a fault costs (``bench/pages/goodput.md``). A spare has paid that ahead: ``serve`` imports
them (``warm``, from the job's config), then blocks reading one line from its stdin. The
supervisor writes the assignment there (a JSON object: the worker's arguments, the group's own
environment, its log file) and the spare points its stdout and stderr at that log, takes the
environment and runs ``diloco worker`` in this process, as the group's only rank, without a
torchrun agent (a single-rank group's process group needs no rendezvous). Its exit code is the
worker's (0, 2, 75, ...), as the agent's would be. A spare whose stdin closes without an
assignment exits 0. The supervisor then starts a new spare, whose imports no longer delay
anyone's restart.

A spare dies with ``diloco run`` (``DILOCO_PARENT_PID``, as an agent does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.runtime.launch.agent import PARENT_ENV, die_with_parent
from diloco.runtime.ops import exit_codes

#: the environment a spare's worker runs in besides the group's own: one rank of a group of one
SINGLE_RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}


def assignment(worker_args: list[str], env: dict[str, str], log_path: str) -> bytes:
    """The line the supervisor writes to a spare: run ``diloco worker`` with ``worker_args``
    (after ``worker``), ``env`` on top of the spare's, output to ``log_path``."""
    return (json.dumps({"argv": list(worker_args), "env": dict(env), "log": str(log_path)}) + "\n").encode()


def _read_assignment(line: str) -> dict[str, Any]:
    job = json.loads(line)
    if not (isinstance(job, dict) and isinstance(job.get("argv"), list) and isinstance(job.get("env"), dict)
            and isinstance(job.get("log"), str) and all(isinstance(a, str) for a in job["argv"])
            and all(isinstance(k, str) and isinstance(v, str) for k, v in job["env"].items())):
        raise ValueError("a spare's assignment must be {'argv': [str], 'env': {str: str}, 'log': str}")
    return job


def warm(config_path: str | None) -> list[str]:
    """Import what a worker of the job in ``config_path`` (``diloco run``'s resolved config, JSON)
    would import as it starts: torch.distributed, the worker, ``torch._dynamo`` (DDP's constructor
    imports it), the job's link type (``--link``: its module and the ring beneath it), the task's
    entry module and, for the bundled corpus, its package. Returns what
    could not be warmed, one line each: the worker meets and reports it when it starts."""
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    from diloco.runtime.rank import worker  # noqa: F401

    if config_path is None:
        return []
    from diloco.demo import data
    from diloco.job.config_parse import from_dict
    from diloco.job.task import DEMO_ENTRY, load_entry
    from transport.link_spec import link_class

    try:
        cfg = from_dict(json.loads(Path(config_path).read_text()))
        link_class(cfg.transport.link)  # the link's module and the ring, framing and auth beneath it
        load_entry(cfg.train.entry or DEMO_ENTRY)
        if not cfg.data.path:
            data.shakespeare_dir()
    except Exception as e:  # noqa: BLE001 - a spare serves regardless; the worker reports its own errors
        return [f"{type(e).__name__}: {e}"]
    return []


def serve(run_worker: Callable[[list[str]], int], config_path: str | None = None) -> int:
    """``python -m diloco spare [CONFIG]``: import (``warm``), wait for an assignment on stdin,
    then run it with ``run_worker(arguments after "worker")`` (``diloco worker``'s entry; see the
    module doc); returns the exit code."""
    parent = os.environ.get(PARENT_ENV)
    if parent is not None:
        die_with_parent(int(parent))
    for problem in warm(config_path):
        print(f"diloco spare: not warmed: {problem}", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line:
        return exit_codes.DONE
    try:
        job = _read_assignment(line)
    except ValueError as e:
        print(f"diloco spare: {e}", file=sys.stderr, flush=True)
        return exit_codes.CONFIGURATION
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update({**SINGLE_RANK_ENV, **job["env"]})
    return run_worker(job["argv"])


@dataclass
class Spare:
    """A spare started and not yet assigned: its process (stdin a pipe) and its own log."""

    proc: subprocess.Popen
    log_path: Path


def start(env: dict[str, str], log_path: Path, config_path: Path | None = None) -> Spare:
    """Start a spare with ``env`` (no group's credentials: they come with its assignment), warmed
    for the job of ``config_path``; its lines until then go to ``log_path``."""
    argv = [sys.executable, "-m", "diloco", "spare", *([str(config_path)] if config_path is not None else [])]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return Spare(proc, log_path)


def hand_over(spare: Spare, worker_args: list[str], env: dict[str, str], log_path: Path) -> None:
    """Make ``spare`` run ``diloco worker worker_args`` with ``env``, logging to ``log_path``.
    OSError when it is gone (a closed pipe)."""
    assert spare.proc.stdin is not None
    spare.proc.stdin.write(assignment(worker_args, env, str(log_path)))
    spare.proc.stdin.close()
