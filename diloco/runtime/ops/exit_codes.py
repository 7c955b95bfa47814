"""What the exit code of a ``diloco`` process says, and which codes a restart can fix.

    0   done (trained, or joined after the job had finished; a worker stopped by ``--stop-after``)
    1   another error: a bug or something this table does not know; a restart would repeat it
    2   configuration: a flag, a file, a path, a corrupt checkpoint, different initial weights, or
        a job the coordinator halted (its groups differ with no majority); deterministic, so
        never restarted (the message names what to change)
    75  restart me: a fault (this group was declared failed, a peer or the coordinator was lost,
        a rank was killed), or SIGTERM before the job finished (``for_signal``); a restarted
        group joins again and heals
    130 interrupted (Ctrl-C; ``diloco run`` stopped by a signal)

``TABLE`` is the same, as the docs show it (docs/operations.md, "Exit codes").

``diloco torchrun`` (``diloco.runtime.launch.agent``) keeps these through torchrun, which reports any
failure of its workers as 1: ``group_exit_code`` makes one code of its ranks' codes. ``diloco run``
restarts a group for ``restartable`` codes only, as a Kubernetes Job's podFailurePolicy does.
"""

from __future__ import annotations

import errno
import signal
from typing import Mapping

DONE = 0
OTHER = 1
CONFIGURATION = 2
RESTART = 75  # EX_TEMPFAIL of sysexits.h: "try again later"
INTERRUPTED = 130

MEANING = {DONE: "done", OTHER: "error", CONFIGURATION: "configuration error", RESTART: "restart me",
           INTERRUPTED: "interrupted"}

#: The exit-code table, the one source of the "Exit codes" section of docs/operations.md (which a
#: test checks against it): (code, when a process exits with it, what a scheduler does with it).
TABLE: tuple[tuple[int, str, str], ...] = (
    (DONE, "the job finished (trained; or joined after it had finished); a coordinator whose groups all "
           "reported", "nothing: the Job is complete"),
    (OTHER, "an unexpected error (a bug, ours or in `--entry` code: the traceback is in the log); a coordinator "
            "whose groups' parameters diverged", "count it as a failure; a restart would repeat it"),
    (CONFIGURATION, "a deterministic error, on every side that sees it: a flag, a path, a port, a corrupt "
                    "checkpoint, different initial weights, a wrong secret or certificate, a run folder in "
                    "use, a job the coordinator halted", "fail for good (never restart); the message names what "
                    "to change"),
    (RESTART, "a fault, or a stop from outside before the job finished: SIGTERM to the coordinator or to "
              "`diloco torchrun` (a deleted, evicted or preempted pod, a drain), a peer lost inside the group "
              "(Gloo, NCCL), the group declared failed or evicted, the coordinator lost, every group lost",
              "restart it (it rejoins, heals, or resumes from its checkpoints)"),
    (INTERRUPTED, "a person stopped it: Ctrl-C, or `diloco run` stopped by SIGINT or SIGTERM (with a "
                  "checkpoint and the `--resume` command, or before anything was trained)",
     "nothing: resume by hand"),
)

# errors of a path the user named: what is there, or who may write it, is wrong
_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EEXIST, errno.EROFS,
                errno.ENOSPC, errno.ENAMETOOLONG, errno.ELOOP}
# coordinator answers that mean it is gone or this group is out, and those that mean a setting is wrong
_COORDINATOR_FAULTS = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "NOT_FOUND", "FAILED_PRECONDITION",
                       "ABORTED", "RESOURCE_EXHAUSTED", "UNKNOWN", "INTERNAL"}
_COORDINATOR_SETTINGS = {"UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "UNIMPLEMENTED"}


def describe(code: int) -> str:
    """``code`` with its meaning: ``75 (restart me)``; a negative code is death by a signal."""
    if code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"{code} (killed by signal {-code})"
    return f"{code} ({MEANING.get(code, 'error')})"


def restartable(code: int) -> bool:
    """True for the codes of a fault that a restart can fix: 75, or death by a signal (a negative
    code as ``subprocess`` reports it, or 128 + the signal's number as a shell and Kubernetes do,
    SIGINT's 130 excepted: that is the user's Ctrl-C)."""
    return code == RESTART or code < 0 or (128 < code < 128 + 65 and code != INTERRUPTED)


def for_signal(signum: int) -> int:
    """The exit code of a process stopped by signal ``signum`` before its job finished: SIGINT
    (Ctrl-C, a person) is 130; any other (SIGTERM from a scheduler: a deleted, evicted or
    preempted pod, a node drain) is 75, "restart me", never 0 (which ends a Kubernetes Job)
    nor 128 + N (which a podFailurePolicy counts as a failure)."""
    return INTERRUPTED if signum == signal.SIGINT else RESTART


def for_exception(exc: BaseException) -> int:
    """The exit code a rank's uncaught error stands for (see the module doc)."""
    from diloco.coordinator import CoordinatorError
    from diloco.engine.initial import InitialParamsMismatch
    from diloco.exchange.heartbeat import GroupEvicted, JobHalted
    from diloco.exchange.quorum_averager import ExchangeFailed
    from transport import TransportError
    from transport.errors import PeerAuthError, auth_cause

    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(exc, JobHalted) or (isinstance(exc, CoordinatorError) and exc.halted):
        return CONFIGURATION  # the coordinator halted the job: a restart meets it halted again
    if isinstance(exc, ExchangeFailed) and getattr(exc, "auth_failure", None) is not None:
        return CONFIGURATION  # every attempt met a wrong secret or certificate: so would a restarted group
    if isinstance(exc, (GroupEvicted, ExchangeFailed)):
        return RESTART
    if isinstance(exc, CoordinatorError):
        if exc.code in _COORDINATOR_SETTINGS:
            return CONFIGURATION
        return RESTART if exc.code in _COORDINATOR_FAULTS else OTHER
    if isinstance(exc, PeerAuthError) or auth_cause(exc) is not None:
        return CONFIGURATION  # a wrong secret or certificate (also behind an aborted collective): the same again
    if isinstance(exc, (TransportError, ConnectionError, TimeoutError)):
        return RESTART
    if _is_distributed_error(exc) or is_peer_lost(exc):
        return RESTART  # the group's own collectives (Gloo, NCCL) lost a rank
    if isinstance(exc, (ValueError, InitialParamsMismatch)):
        return CONFIGURATION  # ConfigError, CheckpointError, TaskError, DataError, PlacementError ...
    if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS:
        return CONFIGURATION
    return OTHER


#: how Gloo and NCCL word a lost peer when they raise a plain RuntimeError (lower case, searched for)
#: (not "connection refused", "unhandled system error" or "connectFullMesh failed": a group that cannot
#: form at all, a /dev/shm too small, a NetworkPolicy or interface setting, would restart for ever)
PEER_LOST_WORDS = ("connection reset by peer", "connection closed by peer", "broken pipe",
                   "socket timeout", "ncclremoteerror", "remote process exited or there was a network error",
                   "nccl communicator was aborted", "watchdog caught collective operation timeout")


def is_peer_lost(exc: BaseException) -> bool:
    """True for a RuntimeError in which the group's own collectives (Gloo, NCCL) report a lost
    peer: their C++ errors reach Python as plain RuntimeError, known only by their words."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(word in text for word in PEER_LOST_WORDS)


def _is_distributed_error(exc: BaseException) -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(exc, dist.DistError)


def group_exit_code(rank_codes: Mapping[int, int]) -> int:
    """One exit code for a group from its failed ranks' codes (negative: killed by that signal).

    A configuration error on any rank makes the group's 2 (it would repeat); else a rank killed
    by anything but SIGTERM (which is how torchrun stops the other ranks once one failed) makes it
    75; else a rank's own error makes it 1, even where its peers asked for a restart (they lost
    it: a rank's bug must count against its Job's budget, not restart it for ever); ranks that
    asked for a restart or were only stopped with SIGTERM make it 75.
    """
    codes = set(rank_codes.values())
    if not codes or codes == {DONE}:
        return DONE
    if CONFIGURATION in codes:
        return CONFIGURATION
    if any(c < 0 and c != -signal.SIGTERM for c in codes):
        return RESTART  # a rank was killed (SIGKILL, out of memory): the others' errors follow from it
    if codes - {DONE, RESTART, -signal.SIGTERM, INTERRUPTED}:
        return OTHER  # a rank's own error wins over the 75 its peers then exit with (a lost peer)
    return RESTART
