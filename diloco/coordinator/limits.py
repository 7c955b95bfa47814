"""Bounds on what callers may hold of the coordinator: concurrent calls, and time to send a request.

gRPC's synchronous server runs every call on a thread of one pool, and a unary call's thread
waits, without a deadline, for the request to arrive. So floods of blocking calls (joins, quorums,
votes, offers waiting up to the join timeout) or of slowly sent requests could take every thread,
and even ``Ping`` would queue. The server (``server.py``) therefore

* counts *blocking* calls (Join, Quorum, Commit, WaitOffer) per caller and overall, and *quick*
  calls (everything else but Ping) per caller and overall, before reading a request byte; a call
  over a cap is answered RESOURCE_EXHAUSTED at once (clients retry with backoff);
* gives each request ``request_timeout_s`` to arrive (`Deadlines`), then cancels the call;
* sizes its pool to the caps plus spare threads, so ``Ping`` (no slot, no request read) always
  finds a thread.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

BLOCKING = frozenset({"Join", "Quorum", "Commit", "WaitOffer"})
#: threads beyond the caps, for Ping and for refusing calls over a cap
SPARE_THREADS = 8
#: calls gRPC may hold beyond the pool's threads (queued) before it refuses new ones itself
QUEUED_CALLS = 256
DEFAULT_MAX_QUICK_CALLS = 64
DEFAULT_MAX_QUICK_PER_CALLER = 16
DEFAULT_REQUEST_TIMEOUT_S = 5.0


class CallLimits:
    """Concurrent-call caps, by kind (blocking or quick), per caller key and overall (thread-safe)."""

    def __init__(self, max_blocking: int, max_blocking_per_caller: int, max_quick: int,
                 max_quick_per_caller: int) -> None:
        for name, v in (("max_blocking_calls", max_blocking), ("max_blocking_per_caller", max_blocking_per_caller),
                        ("max_quick_calls", max_quick), ("max_quick_per_caller", max_quick_per_caller)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.caps = {True: (max_blocking, max_blocking_per_caller), False: (max_quick, max_quick_per_caller)}
        self._lock = threading.Lock()
        self._total = {True: 0, False: 0}
        self._by_caller: dict[bool, collections.Counter[str]] = {True: collections.Counter(),
                                                                 False: collections.Counter()}
        self.rejected = 0
        self.peak = {True: 0, False: 0}

    def enter(self, blocking: bool, caller: str) -> str | None:
        """Take a slot; None when granted, else why not (counted in ``rejected``)."""
        total_cap, caller_cap = self.caps[blocking]
        kind = "blocking" if blocking else "quick"
        with self._lock:
            if self._by_caller[blocking][caller] >= caller_cap:
                self.rejected += 1
                return (f"{caller} already has {caller_cap} {kind} calls in progress (the most allowed per caller); "
                        "retry later")
            if self._total[blocking] >= total_cap:
                self.rejected += 1
                return f"{total_cap} {kind} calls already in progress (the most allowed); retry later"
            self._total[blocking] += 1
            self._by_caller[blocking][caller] += 1
            self.peak[blocking] = max(self.peak[blocking], self._total[blocking])
            return None

    def leave(self, blocking: bool, caller: str) -> None:
        """Give back a slot taken by ``enter``."""
        with self._lock:
            self._total[blocking] -= 1
            self._by_caller[blocking][caller] -= 1
            if self._by_caller[blocking][caller] <= 0:
                del self._by_caller[blocking][caller]

    def in_progress(self, blocking: bool) -> int:
        """Calls of that kind holding a slot now."""
        with self._lock:
            return self._total[blocking]


class Deadlines:
    """One thread that calls a callback for every deadline that passes before it is disarmed."""

    def __init__(self, name: str = "coordinator-deadlines") -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._armed: set[int] = set()
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self.fired = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, deadline: float, callback: Callable[[], None]) -> int:
        """Call ``callback()`` at ``deadline`` (time.monotonic() s) unless disarmed; returns a token."""
        with self._cond:
            token = next(self._seq)
            self._armed.add(token)
            heapq.heappush(self._heap, (deadline, token, callback))
            self._cond.notify()
            return token

    def disarm(self, token: int) -> bool:
        """Cancel a deadline; False if it already fired."""
        with self._cond:
            if token in self._armed:
                self._armed.discard(token)
                return True
            return False

    def _run(self) -> None:
        while True:
            due: list[Callable[[], None]] = []
            with self._cond:
                while not self._closed and not due:
                    now = time.monotonic()
                    while self._heap and (self._heap[0][1] not in self._armed or self._heap[0][0] <= now):
                        _, token, cb = heapq.heappop(self._heap)
                        if token in self._armed:
                            self._armed.discard(token)
                            due.append(cb)
                    if not due:
                        self._cond.wait(self._heap[0][0] - now if self._heap else None)
                if self._closed:
                    return
                self.fired += len(due)
            for cb in due:
                try:
                    cb()
                except Exception:  # a failing callback must not stop the others
                    log.exception("deadline callback failed")

    def close(self) -> None:
        """Stop the thread (armed deadlines never fire)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(2.0)
