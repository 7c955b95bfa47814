"""Makes tests/cuda_helpers.py importable from every test folder (pytest runs with --import-mode=importlib),
and holds every test to ending the processes it starts (with Ctrl-C heard, however pytest was started).

Each test runs with DILOCO_TEST_PROCESS_TAG=<this pytest's pid>:<test id> in its environment, which every
process it starts inherits (unless the test hands it a clean environment). After the test, a process still
carrying its tag is an error naming the test and the command line, and is killed, so that a forgotten
coordinator or torchrun agent can neither hold CI's output pipe open after the run nor disturb later tests.
At the session's end, any process still carrying this session's tag (one a module- or session-scoped
fixture forgot) is killed and named.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

_here = str(Path(__file__).resolve().parent)
if _here not in sys.path:
    sys.path.append(_here)

TAG = "DILOCO_TEST_PROCESS_TAG"
SESSION = f"{os.getpid()}"
LEAK_GRACE_S = float(os.environ.get("DILOCO_TEST_LEAK_GRACE_S", "10"))
# helpers multiprocessing starts once for pytest's own process; they end with it
_PYTEST_HELPERS = ("from multiprocessing.resource_tracker import main", "from multiprocessing.forkserver import main")
os.environ[TAG] = f"{SESSION}:"
# a suite started in the background of a non-interactive shell (`nohup pytest ... &`) inherits SIGINT
# ignored, and so would every process the tests start and send Ctrl-C to (Python keeps an ignored
# SIGINT ignored): those tests would wait for an exit that never comes
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def processes_tagged(tag: str, *, prefix: bool = False) -> list[tuple[int, str]]:
    """(pid, command line) of every live process but this one whose tag is tag (or, with prefix, starts so)."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
            if not any(var.startswith(needle) if prefix else var == needle for var in environ.split(b"\0")):
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if not any(helper in cmdline for helper in _PYTEST_HELPERS):
            found.append((int(entry.name), cmdline[:200]))
    return found


def _kill(found: list[tuple[int, str]]) -> None:
    for pid, _ in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _blocking_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Live threads not in ``before`` that are non-daemon (each would keep the interpreter from
    exiting) or pending timers (one may end the whole process later, like --stop-grace's)."""
    return [t for t in threading.enumerate() if t not in before and t.is_alive()
            and (not t.daemon or isinstance(t, threading.Timer))]


@pytest.fixture(autouse=True)
def _ends_what_it_starts(request):
    """Fails (and kills) the processes a test leaves running LEAK_GRACE_S after it returns, and fails
    on the non-daemon threads it leaves (a thread cannot be killed: it would hold pytest at exit)."""
    tag = f"{SESSION}:{request.node.nodeid}"
    threads_before = set(threading.enumerate())
    os.environ[TAG] = tag
    try:
        yield
    finally:
        os.environ[TAG] = f"{SESSION}:"
    deadline = time.monotonic() + LEAK_GRACE_S
    left, threads = processes_tagged(tag), _blocking_threads(threads_before)
    while (left or threads) and time.monotonic() < deadline:
        time.sleep(0.2)
        left, threads = processes_tagged(tag), _blocking_threads(threads_before)
    _kill(left)
    problems = [f"pid {pid}: {cmd}" for pid, cmd in left] + [f"thread {t.name!r}" for t in threads]
    if problems:
        pytest.fail("the test left running (processes now killed): " + "; ".join(problems), pytrace=False)


_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))
    left = processes_tagged(f"{SESSION}:", prefix=True)
    if left:
        _kill(left)
        print(f"\nconftest: killed {len(left)} process(es) the tests left running: "
              + "; ".join(f"pid {pid}: {cmd}" for pid, cmd in left), file=sys.stderr)


def pytest_unconfigure(config):
    """Ends pytest even when a test left a non-daemon thread waiting (already reported as an error):
    Python would otherwise wait for it at exit, for ever, and hold CI until its timeout."""
    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if stuck and _exit_status:
        print(f"conftest: {len(stuck)} non-daemon thread(s) still running at exit "
              f"({', '.join(repr(t.name) for t in stuck)}); exiting with pytest's status {_exit_status[0]}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(_exit_status[0])
