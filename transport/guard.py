"""Admission of incoming connections before they authenticate: caps and a whole-handshake deadline.

A listener on the internet meets scanners and attackers. Each accepted stream (a TCP connection or
a gRPC call) takes a *ticket* here before a byte is read:

* at most `max_unauthenticated` tickets are live per listener and `max_unauthenticated_per_source`
  per source address; over either cap the stream is refused at once (`rejected` counts them);
* a ticket that has not been marked authenticated `handshake_timeout_s` seconds after it was taken
  is expired: its stream is closed however slowly bytes trickle in (`timed_out` counts them). The
  deadline thread wakes `REAP_LEAD_S` early, so a busy host does not carry a stream past it.

An authenticated stream gives its ticket back, so honest members never compete with the caps once
connected. Members still need a slot to connect, and an attacker with many source addresses can
fill a listener's shared slots; so *known* sources — one a member authenticated from, or the host
of an address a collective names as a peer (`know`) — take their tickets from a reserved pool of
`max_per_known_source` slots each, which strangers cannot use. An attacker can take a member's
reserved slots only by sending from the member's own address.
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

DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
DEFAULT_MAX_UNAUTHENTICATED = 64
DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE = 8
DEFAULT_MAX_PER_KNOWN_SOURCE = 8
MAX_KNOWN_SOURCES = 4096  # known sources remembered, least recently seen dropped first
REAP_LEAD_S = 0.05  # seconds before its deadline that an unauthenticated stream may be closed


class Ticket:
    """One stream's place among the unauthenticated ones; `closer` ends the stream."""

    __slots__ = ("source", "admitted", "deadline", "closer", "state", "seq", "known")

    def __init__(self, source: str, admitted: float, deadline: float, closer: Callable[[], None], seq: int,
                 known: bool) -> None:
        self.source = source
        self.admitted = admitted  # time.monotonic() seconds
        self.deadline = deadline  # time.monotonic() seconds
        self.closer = closer
        self.state = "pending"  # -> "authenticated" | "expired" | "released"
        self.seq = seq
        self.known = known  # holds a reserved slot of a known source


class AdmissionGuard:
    """Caps and deadlines for unauthenticated streams of one listener (thread-safe).

    handshake_timeout_s: seconds from admission until the stream must have authenticated.
    max_unauthenticated: streams of this listener allowed to be unauthenticated at once.
    max_per_source: of those, how many may come from one source address.
    max_per_known_source: reserved slots of each known source, outside the two caps above.
    on_tick: called from the deadline thread about every TICK_S seconds (housekeeping of the owner).
    """

    TICK_S = 1.0

    def __init__(self, handshake_timeout_s: float, max_unauthenticated: int, max_per_source: int, name: str = "",
                 on_tick: Callable[[], None] | None = None,
                 max_per_known_source: int = DEFAULT_MAX_PER_KNOWN_SOURCE) -> None:
        if handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {handshake_timeout_s}")
        if max_unauthenticated < 1 or max_per_source < 1 or max_per_known_source < 1:
            raise ValueError(f"caps on unauthenticated connections must be >= 1, got {max_unauthenticated} "
                             f"per listener, {max_per_source} per source, {max_per_known_source} per known source")
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.max_unauthenticated = int(max_unauthenticated)
        self.max_per_source = int(max_per_source)
        self.max_per_known_source = int(max_per_known_source)
        self.name = name
        self._on_tick = on_tick
        self.rejected = 0
        self.timed_out = 0
        self.peak = 0  # most shared-pool tickets (strangers') live at once
        self.peak_reserved = 0  # most reserved tickets (known sources') live at once
        self.longest_s = 0.0  # longest a stream was held unauthenticated (admission to close or auth)
        self._live: set[Ticket] = set()
        self._by_source: collections.Counter[str] = collections.Counter()
        self._shared = 0  # live tickets from the shared pool (strangers)
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._heap: list[tuple[float, int, Ticket]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._reap, name=f"handshake-deadlines@{name}", daemon=True)
        self._thread.start()

    @property
    def live(self) -> int:
        """Streams admitted and not yet authenticated, expired or released."""
        with self._cond:
            return len(self._live)

    def know(self, source: str) -> None:
        """Reserve slots for source (an address without port): a member is there."""
        with self._cond:
            self._known[source] = None
            self._known.move_to_end(source)
            while len(self._known) > MAX_KNOWN_SOURCES:
                self._known.popitem(last=False)

    def is_known(self, source: str) -> bool:
        """Whether source's streams take reserved slots."""
        with self._cond:
            return source in self._known

    def admit(self, source: str, closer: Callable[[], None]) -> Ticket | None:
        """A ticket for a new stream from source, or None (counted as rejected) over a cap."""
        with self._cond:
            known = source in self._known
            if known:
                full = self._by_source[source] >= self.max_per_known_source
            else:
                full = self._shared >= self.max_unauthenticated or self._by_source[source] >= self.max_per_source
            if self._closed or full:
                self.rejected += 1
                return None
            now = time.monotonic()
            t = Ticket(source, now, now + self.handshake_timeout_s, closer, next(self._seq), known)
            self._live.add(t)
            self._by_source[source] += 1
            self._shared += not known
            self.peak = max(self.peak, self._shared)
            self.peak_reserved = max(self.peak_reserved, len(self._live) - self._shared)
            heapq.heappush(self._heap, (t.deadline, t.seq, t))
            self._cond.notify()
            return t

    def authenticated(self, ticket: Ticket) -> bool:
        """Mark the stream authenticated (frees its slot, makes its source known); False if its
        deadline already passed."""
        ok = self._finish(ticket, "authenticated")
        if ok:
            self.know(ticket.source)
        return ok

    def release(self, ticket: Ticket) -> None:
        """The stream ended before authenticating (or was refused): free its slot."""
        self._finish(ticket, "released")

    def _finish(self, ticket: Ticket, state: str) -> bool:
        with self._cond:
            if ticket.state != "pending":
                return ticket.state == state
            self._drop(ticket, state)
            return True

    def _drop(self, ticket: Ticket, state: str) -> None:
        """Caller holds the lock."""
        ticket.state = state
        self.longest_s = max(self.longest_s, time.monotonic() - ticket.admitted)
        self._live.discard(ticket)
        self._shared -= not ticket.known
        self._by_source[ticket.source] -= 1
        if self._by_source[ticket.source] <= 0:
            del self._by_source[ticket.source]

    def _reap(self) -> None:
        next_tick = time.monotonic() + self.TICK_S
        while True:
            with self._cond:
                if self._closed:
                    return
                expired = self._pop_expired(time.monotonic())
                if not expired:
                    wake = min(self._heap[0][0] - REAP_LEAD_S, next_tick) if self._heap else next_tick
                    self._cond.wait(max(0.0, wake - time.monotonic()))
                    expired = self._pop_expired(time.monotonic())
            self._close_expired(expired)
            if self._on_tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.TICK_S
                try:
                    self._on_tick()
                except Exception:  # housekeeping must not stop the deadlines
                    log.exception("periodic housekeeping failed")

    def _pop_expired(self, now: float) -> list[Ticket]:
        """Expire every pending ticket whose deadline is (within REAP_LEAD_S) past (caller holds the lock)."""
        expired: list[Ticket] = []
        while self._heap and (self._heap[0][2].state != "pending" or self._heap[0][0] <= now + REAP_LEAD_S):
            _, _, t = heapq.heappop(self._heap)
            if t.state == "pending":
                self._drop(t, "expired")
                self.timed_out += 1
                expired.append(t)
        return expired

    def _close_expired(self, expired: list[Ticket]) -> None:
        """Close first, log after: a burst of expiries must not wait on each other's log lines."""
        for t in expired:
            try:
                t.closer()
            except Exception:  # closing must not stop the reaper
                log.exception("closing an expired connection failed")
            life = time.monotonic() - t.admitted
            with self._cond:
                self.longest_s = max(self.longest_s, life)
        if expired:
            sources = collections.Counter(t.source for t in expired)
            log.warning("%s: closed %d connection(s) that did not authenticate within %g s (from %s)", self.name,
                        len(expired), self.handshake_timeout_s, ", ".join(f"{s} ×{n}" for s, n in sources.most_common(8)))

    def close(self) -> None:
        """Stop the deadline thread (live tickets are closed by the transport's own close)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(2.0)
