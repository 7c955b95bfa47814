"""A rank's liveness towards the coordinator: its heartbeats, and its patience with the coordinator's calls.

A background thread heartbeats the coordinator (``Heartbeat``). After a coordinator restart
(NOT_FOUND) the rank rejoins with its group's incarnation and next exchange, so the new coordinator
rebuilds the membership from the members; a FAILED_PRECONDITION (this group was declared failed or
evicted) stops the group at its next exchange with ``GroupEvicted``: restart it (torchrun
``--max-restarts``, or ``diloco run``'s supervisor) and it heals. Every other call to the coordinator
goes through ``CoordinatorRetry``, which retries while the coordinator is unreachable or busy.

Both act for the rank's ``QuorumAverager`` (``avg``: its group, rank, incarnation, client, ``rejoin``,
``leave`` and fault counters), which owns them; this module imports nothing of it.
"""

from __future__ import annotations

import logging
import threading
import time

from diloco.coordinator import CoordinatorError

log = logging.getLogger("diloco.exchange.quorum_averager")  # one logger for the averager's messages, as before the split

RETRYABLE = ("DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED", "RESOURCE_EXHAUSTED")
#: seconds between heartbeats while rings run: how soon rings wait no more for a member the
#: coordinator declared failed (a heartbeat names the oldest running quorum; see Heartbeat._loop)
RING_CHECK_S = 1.0


class GroupEvicted(RuntimeError):
    """The coordinator took this group out of the job (declared failed, out of step, or its state
    differed). Restart the group's processes: they join again and heal."""


class JobHalted(RuntimeError):
    """The coordinator halted the job: its members differ (state hash, setting, size, weight cap)
    with no majority, again, so no group can be trusted over another. A restart would meet the
    same halted coordinator: the rank stops with exit 2 and the message naming the groups."""


class CoordinatorRetry:
    """Calls the coordinator until it answers: retries while it is unreachable or busy (with
    backoff, up to ``limit_s``), rejoins it after a restart (NOT_FOUND), and turns "this group is
    out" (FAILED_PRECONDITION) into GroupEvicted."""

    def __init__(self, averager, limit_s: float) -> None:
        self.avg, self.limit_s = averager, limit_s

    def __call__(self, what: str, call, *, on_not_found=None):
        deadline = time.monotonic() + self.limit_s
        delay, rejoined = 0.1, False
        while True:
            try:
                return call()
            except CoordinatorError as e:
                if e.code == "FAILED_PRECONDITION":
                    raise (JobHalted if e.halted else GroupEvicted)(f"group {self.avg.group}: {e}") from None
                if e.code == "NOT_FOUND" and not rejoined:
                    rejoined = True
                    self.avg.rejoin()
                    continue
                if e.code == "NOT_FOUND" and on_not_found is not None:
                    return on_not_found(e)
                if e.code not in RETRYABLE or time.monotonic() > deadline:
                    raise
                log.warning("%s: coordinator did not answer (%s); retrying in %.1fs", what, e.code, delay)
                time.sleep(delay)
                delay = min(2 * delay, 5.0)


class Heartbeat:
    """Heartbeats the coordinator for one rank of ``averager`` in a background thread, every
    ``interval_s``, and holds the handles of the rings this rank runs (``track``, ``done``), so
    that it can abort them when the coordinator says their quorum can no longer commit."""

    def __init__(self, averager, interval_s: float) -> None:
        self.avg = averager
        self._lock = threading.Lock()
        self._running: dict[str, list] = {}  # quorum id -> the handles of this rank's rings in it, oldest first
        #: set: no more heartbeats (``close``; a test's frozen or killed rank)
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,),
                                        name=f"heartbeat[{averager.group}/{averager.rank}]", daemon=True)
        self._thread.start()

    def track(self, quorum: str, handles: list) -> None:
        """The rings of ``quorum`` run here now; aborted at once if this group was told to leave
        already (a heartbeat refused since found no rings here to abort)."""
        with self._lock:
            self._running[quorum] = handles
            evicted = self.avg.evicted_reason
        if evicted is not None:
            self.abort(quorum, evicted)

    def done(self, quorum: str) -> None:
        """The rings of ``quorum`` ended here."""
        with self._lock:
            self._running.pop(quorum, None)

    def abort(self, quorum: str, why: str) -> None:
        """Abort the rings of ``quorum`` running here, telling them ``why``."""
        with self._lock:
            handles = self._running.pop(quorum, [])
        if handles:
            log.warning("group %d rank %d: aborting the rings of %s: %s", self.avg.group, self.avg.rank, quorum, why)
            self.avg.stats.aborted_lost += 1
        for h in handles:
            h.abort(f"the coordinator says: {why}")

    def close(self) -> None:
        """Stop heartbeating."""
        self.closed.set()

    def _loop(self, interval_s: float) -> None:
        """Heartbeats, every ``interval_s`` from one's start to the next's (every RING_CHECK_S at
        most while rings run). Each
        names the oldest quorum whose rings run here; when the coordinator says that quorum can
        no longer commit (a member failed or started again), its rings are aborted at once: this
        rank votes no and retries in the next quorum instead of waiting for the rings' deadline.
        When it says this group was declared failed, every ring here is aborted and the group
        leaves at its next call (``GroupEvicted``)."""
        avg = self.avg
        wait = interval_s
        while not self.closed.wait(wait):
            sent = time.monotonic()
            with self._lock:
                quorum = next(iter(self._running), "")
            period = min(interval_s, RING_CHECK_S) if quorum else interval_s
            try:
                lost = avg.client.heartbeat(avg.group, avg.rank, avg.step, avg.incarnation, quorum)
                if lost:
                    self.abort(quorum, lost)
            except CoordinatorError as e:
                if e.code == "FAILED_PRECONDITION":  # declared failed (e.g. woken from a freeze): the
                    avg.leave(str(e), halted=e.halted)  # others left its exchanges, so its rings would wait in vain
                    with self._lock:
                        running = list(self._running)
                    for q in running:
                        self.abort(q, str(e))
                elif e.code == "NOT_FOUND":
                    try:
                        avg.rejoin()
                    except CoordinatorError as again:
                        log.warning("rejoining the coordinator failed: %s", again)
                    except GroupEvicted:  # a healer: its evicted_reason says so at its next call
                        return
            except ValueError:  # the channel was closed under us: we are closing
                return
            # the next one is due a period after this one started: a slow call does not stretch the
            # silence the coordinator sees (it counts three periods as silent)
            wait = max(sent + period - time.monotonic(), 0.0)
