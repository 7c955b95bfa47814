"""When a rank's last words include a traceback: a rank's uncaught error is one line with its exit
code, and the whole traceback too where a line is not enough.

The traceback is printed (to the rank's stderr: ``diloco run``'s group log, ``kubectl logs``) when
the error passed through the user's own ``--entry`` code (its package's modules: the line alone
would hide where in it), when the error is unexpected (exit code 1: a bug, ours or the user's), or
always with ``DILOCO_TRACEBACK=1`` in the environment. A configuration error (2) or a fault (75)
raised by diloco itself keeps its one line, which names what to change or what was lost.
"""

from __future__ import annotations

import os
import types

from diloco.runtime.ops import exit_codes

TRACEBACK_ENV = "DILOCO_TRACEBACK"


def entry_package(entry: str) -> str | None:
    """The top-level package of an ``--entry package.module:function`` (None: no entry, or the
    demo, which is diloco's own)."""
    if not entry or ":" not in entry:
        return None
    package = entry.split(":", 1)[0].split(".", 1)[0]
    return None if package == "diloco" else package


def _frames(exc: BaseException) -> list[types.FrameType]:
    """Every frame of ``exc``'s traceback and of the errors it was raised from (or during)."""
    frames, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return frames


def raised_in(exc: BaseException, package: str | None) -> bool:
    """True if ``exc`` (or an error it came from) passed through a module of ``package``."""
    if not package:
        return False
    names = (str(f.f_globals.get("__name__", "")) for f in _frames(exc))
    return any(n == package or n.startswith(package + ".") for n in names)


def wants_traceback(exc: BaseException, entry: str, env: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether a rank's uncaught ``exc`` is shown with its traceback (see the module doc)."""
    if env.get(TRACEBACK_ENV, "") not in ("", "0"):
        return True
    return exit_codes.for_exception(exc) == exit_codes.OTHER or raised_in(exc, entry_package(entry))
