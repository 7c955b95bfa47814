"""``diloco torchrun``: torchrun whose exit code says why its workers stopped.

``diloco torchrun ARGS`` takes exactly torchrun's arguments (``--nproc-per-node 8 -m diloco worker
...``) and runs torchrun's own elastic agent in this process. torchrun reports any failure of its
workers as exit code 1; this one exits with ``exit_codes.group_exit_code`` of the workers' codes,
so ``diloco run``'s supervisor and a Kubernetes Job's podFailurePolicy can tell "done" (0), "restart
me" (75) and "configuration error" (2) apart. A death signal to the agent (SIGTERM on a node
drain) stops the workers as torchrun does and exits 128 + the signal's number.

``DILOCO_PARENT_PID``: the agent dies with that process (Linux's parent-death signal), so a
``diloco run`` that is killed outright leaves no group behind; the agent hands its own PID on
the same way, so each worker dies with its agent in turn (``diloco worker`` asks for it first
thing, before it loads torch).
"""

from __future__ import annotations

import os
import sys

from diloco.runtime import exit_codes, stack_dumps

PARENT_ENV = "DILOCO_PARENT_PID"


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit at once (75) if the parent,
    ``expected_parent`` when given, is already gone (its death came before the request)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(exit_codes.RESTART)


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``name`` (``--name=V`` or ``--name V``) in the workers' arguments, or None."""
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; returns the group's exit code (see the module doc). With
    ``--log-format json`` among the workers' arguments, this process logs JSON too."""
    parent = os.environ.get(PARENT_ENV)
    if parent is not None:
        die_with_parent(int(parent))
    os.environ[PARENT_ENV] = str(os.getpid())  # the workers', whose parent this process is
    stack_dumps.forward_to_children()  # kill -USR1 (PID 1 of a pod): the workers dump their threads' stacks
    fmt, group = _flag(argv, "--log-format"), _flag(argv, "--group-id")
    if fmt == "json":  # the agent's own lines (torchrun's, the C++ store's) are records like its workers'
        from diloco.runtime import logs

        logs.setup("json", component="torchrun", group=int(group) if group and group.isdigit() else None)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main(argv)
    except ChildFailedError as e:
        codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        code = exit_codes.group_exit_code(codes)
        ranks = ", ".join(f"rank {r}: {exit_codes.describe(c)}" for r, c in sorted(codes.items()))
        print(f"diloco torchrun: workers stopped ({ranks}); exit {exit_codes.describe(code)}",
              file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        print(f"diloco torchrun: {e.sigval.name}: stopped every worker", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return exit_codes.DONE
