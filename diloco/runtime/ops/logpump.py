"""The process that turns what a ``diloco`` process writes to its file descriptors 1 and 2 into JSON
records (``logs.setup("json")``): run as a script of its own, standard library only.

    python -I logpump.py READ_FD_STDOUT READ_FD_STDERR CONTEXT_JSON

It reads two pipes until every writer closed them, and writes each line to its own stdout
(from the first pipe) or stderr (from the second): a line that is a JSON object already passes
through unchanged, any other line becomes ``{"ts", "level", "logger", "msg", ...context}`` (INFO
from stdout, ERROR from stderr). A process of its own, not a thread: native code that writes to
stderr while holding the interpreter lock would otherwise block on a full pipe that a thread of
the same interpreter can no longer drain.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time


def _timestamp(created: float) -> str:
    """RFC 3339 UTC with milliseconds (as ``diloco.runtime.ops.logs``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def record_line(raw: bytes, level: str, logger: str, context: dict) -> str | None:
    """The JSON line for one line read (None for a blank one)."""
    line = raw.decode("utf-8", errors="replace").rstrip("\r")
    if not line.strip():
        return None
    if line.startswith("{") and line.endswith("}"):
        try:
            json.loads(line)
        except ValueError:
            pass
        else:
            return line
    out = {"ts": _timestamp(time.time()), "level": level, "logger": logger, "msg": line}
    out.update({k: v for k, v in context.items() if v is not None})
    return json.dumps(out, ensure_ascii=False)


def pump(read_fd: int, out, level: str, logger: str, context: dict) -> None:
    """Copy the lines of ``read_fd`` to ``out`` as records until EOF."""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        buffered = b""
        while True:
            chunk = pipe.read(65536)
            if not chunk:
                break
            *lines, buffered = (buffered + chunk).split(b"\n")
            text = [r for r in (record_line(raw, level, logger, context) for raw in lines) if r is not None]
            if text:
                out.write("\n".join(text) + "\n")
                out.flush()
        last = record_line(buffered, level, logger, context) if buffered else None
        if last is not None:
            out.write(last + "\n")
            out.flush()


def main(argv: list[str]) -> int:
    # SIGUSR1 asks a diloco process for its stacks (diloco.runtime.ops.stack_dumps), whose default action
    # would end this pump and cut its process's log: not for the pump
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    out_fd, err_fd, context = int(argv[0]), int(argv[1]), json.loads(argv[2])
    threads = [threading.Thread(target=pump, args=(out_fd, sys.stdout, "INFO", "diloco.stdout", context)),
               threading.Thread(target=pump, args=(err_fd, sys.stderr, "ERROR", "diloco.stderr", context))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
