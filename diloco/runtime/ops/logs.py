"""One logging setup for every ``diloco`` process: text for people (default), JSON for collectors.

    from diloco.runtime.ops import logs
    logs.setup("json", component="worker", group=0, rank=1)
    logging.getLogger("diloco.runtime.rank.worker").info("joined", extra={"epoch": 1})

Every record carries the process's ``component`` (``run``, ``coordinator``, ``worker``) and, in a
worker, its ``group`` and ``rank``; fields given with ``extra=`` are kept. The text format is one
line per record::

    2025-05-20T10:00:00.123Z INFO diloco.runtime.rank.worker [worker group 0 rank 1] joined

The JSON format is one object per line (``ts``, ``level``, ``logger``, ``msg``, ``component``,
``group``, ``rank``, the ``extra`` fields, and ``exc`` with a traceback). With JSON the lines a
process prints to ``sys.stdout`` / ``sys.stderr`` (summaries, error lines, tracebacks) are
re-emitted as records too (stdout at INFO, stderr at ERROR, Python warnings at WARNING), and so
are the lines written straight to the file descriptors 1 and 2 (native libraries: NCCL, Gloo,
torch's C++ warnings; child processes that inherit them, such as torchrun's workers): those go
through a pipe each to a small pump process (``logpump.py``), which turns every line into a
record, passing lines that are JSON objects already (a child's own records) through unchanged. A
collector reads nothing but JSON.
"""

from __future__ import annotations

import atexit
import io
import json
import logging
import os
import sys
import threading
import time
from typing import Any, TextIO

FORMATS = ("text", "json")
LEVEL_ENV = "DILOCO_LOG_LEVEL"
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName"}
_CONTEXT = ("component", "group", "rank")


def _timestamp(created: float) -> str:
    """RFC 3339 UTC with milliseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


class _ContextFilter(logging.Filter):
    """Stamps the process's component, group and rank on every record (unless the record has its own)."""

    def __init__(self, context: dict[str, Any]) -> None:
        super().__init__()
        self.context = context

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.context.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER [component group G rank R] message``."""

    def format(self, record: logging.LogRecord) -> str:
        where = [str(getattr(record, "component", "") or "")]
        if getattr(record, "group", None) is not None:
            where.append(f"group {record.group}")
        if getattr(record, "rank", None) is not None:
            where.append(f"rank {record.rank}")
        tag = " ".join(w for w in where if w)
        line = f"{_timestamp(record.created)} {record.levelname} {record.name} [{tag}] {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record; values that JSON cannot hold are written as their ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record.created), "level": record.levelname, "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _CONTEXT:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and key not in _CONTEXT and key not in out and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _LineLogger(io.TextIOBase):
    """A text stream that turns every complete line written to it into a log record."""

    def __init__(self, logger: logging.Logger, level: int, original: TextIO) -> None:
        super().__init__()
        self._logger, self._level, self.original = logger, level, original
        self._buffer = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            self._buffer += text
            *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            if line.strip():
                self._logger.log(self._level, line.rstrip("\r"))
        return len(text)

    def flush(self) -> None:
        with self._lock:
            line, self._buffer = self._buffer, ""
        if line.strip():
            self._logger.log(self._level, line)

    def fileno(self) -> int:
        return self.original.fileno()

    def isatty(self) -> bool:
        return False


class _FdCapture:
    """File descriptors 1 and 2 redirected into pipes whose lines become records, by a pump process
    of its own (``logpump.py``: see there why not a thread)."""

    def __init__(self, context: dict[str, Any]) -> None:
        import subprocess

        self.saved = {fd: os.dup(fd) for fd in (1, 2)}
        #: where this process's own records go: its real stderr
        self.err = os.fdopen(os.dup(self.saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
        (r_out, w_out), (r_err, w_err) = os.pipe(), os.pipe()
        try:
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "logpump.py")
            self.pump = subprocess.Popen([sys.executable, "-I", script, str(r_out), str(r_err), json.dumps(context)],
                                         pass_fds=(r_out, r_err), stdin=subprocess.DEVNULL,
                                         stdout=self.saved[1], stderr=self.saved[2])
        finally:
            os.close(r_out)
            os.close(r_err)
        for fd, write in ((1, w_out), (2, w_err)):
            os.dup2(write, fd)
            os.close(write)

    def close(self, wait_s: float = 2.0) -> None:
        """Point 1 and 2 back at the real streams; the pump ends once every writer closed its end
        (children may hold it longer), waited for up to ``wait_s``."""
        for stream in (sys.__stdout__, sys.__stderr__):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        for fd, saved in self.saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        try:
            self.pump.wait(wait_s)
        except Exception:  # noqa: BLE001 - children still hold the pipe: the pump ends with them
            pass


_installed: dict[str, Any] = {}


def setup(fmt: str = "text", *, component: str, group: int | None = None, rank: int | None = None,
          level: str | int | None = None, stream: TextIO | None = None, capture_fds: bool | None = None) -> None:
    """Configure the root logger for this process: ``fmt`` ``text`` or ``json``; records go to
    ``stream`` (default: the process's stderr). ``level``: default ``$DILOCO_LOG_LEVEL`` or INFO.
    ``capture_fds``: turn what is written to the file descriptors 1 and 2 into records too
    (default: with JSON to the process's own stderr). Calling it again replaces the previous setup."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    teardown()
    if capture_fds is None:
        capture_fds = fmt == "json" and stream is None
    if capture_fds:
        capture = _FdCapture({"component": component, "group": group, "rank": rank})
        _installed["capture"] = capture
        atexit.register(_close_capture, capture)
        if stream is None:
            stream = capture.err
    out = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_ContextFilter({"component": component, "group": group, "rank": rank}))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level or os.environ.get(LEVEL_ENV, "INFO").upper())
    logging.captureWarnings(True)
    _installed.update(handler=handler, level=root.level)
    if fmt == "json":  # every printed line becomes a JSON record; the handler keeps the real stream
        _installed.update(stdout=sys.stdout, stderr=sys.stderr)
        sys.stdout = _LineLogger(logging.getLogger("diloco.stdout"), logging.INFO, sys.stdout)
        sys.stderr = _LineLogger(logging.getLogger("diloco.stderr"), logging.ERROR, sys.stderr)


def teardown() -> None:
    """Undo ``setup``: restore stdout/stderr and remove its handler (for tests and re-setup)."""
    if "stdout" in _installed:
        for name in ("stdout", "stderr"):
            wrapper = getattr(sys, name)
            if isinstance(wrapper, _LineLogger):
                wrapper.flush()
            setattr(sys, name, _installed.pop(name))
    handler = _installed.pop("handler", None)
    if handler is not None:
        logging.getLogger().removeHandler(handler)
        logging.captureWarnings(False)
    capture = _installed.pop("capture", None)
    if capture is not None:
        _close_capture(capture)
        atexit.unregister(_close_capture)
    _installed.clear()


def _close_capture(capture: _FdCapture) -> None:
    if not getattr(capture, "closed", False):
        capture.closed = True
        capture.close()
