"""Waits that say what they wait for: a log line every few seconds while a caller blocks.

    with waiting(log, "the coordinator at 10.0.0.5:29400 to answer"):
        client.join(...)

logs ``waiting for the coordinator at 10.0.0.5:29400 to answer (10 s so far)`` after 10 s and
every 10 s after that, until the block ends; a wait that ends sooner prints nothing. One daemon
thread serves every wait of the process. Torch-free, as the rest of the coordinator package (whose
client is where most waits are: for the coordinator itself, a quorum, a vote, a donor).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from typing import Callable, Iterator

NOTICE_EVERY_S = 10.0


class _Notices:
    """The process's one notice thread: a heap of (due time, id) over the waits in progress."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._waits: dict[int, tuple[logging.Logger, Callable[[], str], float, float]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, log: logging.Logger, what: Callable[[], str], every_s: float) -> int:
        now = time.monotonic()
        with self._cond:
            wait_id = next(self._ids)
            self._waits[wait_id] = (log, what, every_s, now)
            heapq.heappush(self._heap, (now + every_s, wait_id))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="diloco-wait-notices", daemon=True)
                self._thread.start()
            self._cond.notify()
        return wait_id

    def remove(self, wait_id: int) -> None:
        with self._cond:
            self._waits.pop(wait_id, None)  # its heap entry is skipped when it comes due

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                due, wait_id = heapq.heappop(self._heap)
                entry = self._waits.get(wait_id)
                if entry is None:
                    continue
                log, what, every_s, started = entry
                heapq.heappush(self._heap, (due + every_s, wait_id))
            try:
                text = what()
            except Exception as e:  # noqa: BLE001 - a notice must never break the wait it describes
                text = f"(cannot describe the wait: {e})"
            log.warning("waiting for %s (%.0f s so far)", text, time.monotonic() - started)


_NOTICES = _Notices()


@contextlib.contextmanager
def waiting(log: logging.Logger, what: str | Callable[[], str], every_s: float = NOTICE_EVERY_S) -> Iterator[None]:
    """While the block runs, log ``waiting for <what> (N s so far)`` every ``every_s`` seconds
    (``what`` may be a function, asked each time: the wait's state may change)."""
    if every_s <= 0:
        raise ValueError(f"every_s must be > 0, got {every_s}")
    describe = what if callable(what) else (lambda: what)
    wait_id = _NOTICES.add(log, describe, every_s)
    try:
        yield
    finally:
        _NOTICES.remove(wait_id)
