"""Warnings that an attacker can trigger at will, written at most once a second per kind.

A flood of refused connections or dropped frames must not become a flood of log lines (disk,
CPU, and the operator's attention): the first of a kind is written, further ones within
``interval_s`` are counted and the count goes with the next line written.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """``warning(kind, msg, *args)``: like ``logger.warning``, at most one line per kind per ``interval_s`` seconds."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        """Write the line unless one of this kind was written within interval_s; True if written."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -float("inf")) < self._interval_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            msg += f" (and {held} more like it in the last {self._interval_s:g} s)"
        self._log.warning(msg, *args)
        return True
