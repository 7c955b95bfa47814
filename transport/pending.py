"""Messages that arrive for a tag before its collective starts on this member, kept for it.

A left neighbour may start a collective, and send its first chunks, before this member starts
it. Its messages wait here until a collective with their tag starts (`PendingFrames.take`),
bounded in bytes (`max_bytes`, each message counted as its payload plus `OVERHEAD`) and in time
(a tag's messages are forgotten `ttl_s` seconds after its first one). Messages over either
bound are dropped and counted; a peer can send them at will, so a full buffer logs at most a
line a second.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from .ratelog import RateLimitedLog
from .wire import Message

#: Default bound, in bytes, on frames buffered for collectives that have not started here yet.
DEFAULT_MAX_PENDING_BYTES = 256 << 20
#: Default time, in units of timeout_s, that frames of a tag that never starts here are kept.
DEFAULT_PENDING_TTL_TIMEOUTS = 2.0
OVERHEAD = 64  # bytes counted per buffered message besides its payload


class PendingFrames:
    """The messages kept for tags with no collective here, oldest tag first.

    Not locked: its owner calls it under the lock that also guards the running collectives, so
    a message is either kept here or delivered to its collective, never lost between the two.
    """

    def __init__(self, max_bytes: int, ttl_s: float, log: logging.Logger, where: Callable[[], str]) -> None:
        """max_bytes: bound on the bytes kept; ttl_s: seconds a tag's messages are kept after its
        first; log: where dropped messages are reported, each line prefixed with where()."""
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.nbytes = 0  # kept now, overheads included
        self.dropped = 0  # messages dropped so far: over max_bytes or past ttl_s
        self._tags: collections.OrderedDict[str, _TagFrames] = collections.OrderedDict()
        self._log = log
        self._flood_log = RateLimitedLog(log)
        self._where = where

    def fits(self, nbytes: int) -> bool:
        """Whether a message with nbytes of payload would be kept now (expired tags forgotten first)."""
        self.expire()
        return self.nbytes + nbytes + OVERHEAD <= self.max_bytes

    def add(self, peer: str, msg: Message, event: tuple) -> None:
        """Keep event (the dispatch of msg, from peer) for the collective of msg.tag; dropped if
        msg's payload was discarded unread or it does not fit."""
        self.expire()
        size = len(msg.payload) + OVERHEAD
        if msg.discarded or self.nbytes + size > self.max_bytes:
            self.dropped += 1
            self._flood_log.warning("pending", "%s: dropped %s from %s for not-yet-started tag %r: pending buffers "
                                    "full (max_pending_bytes=%d)", self._where(), msg.type.name, peer, msg.tag,
                                    self.max_bytes)
            return
        kept = self._tags.get(msg.tag)
        if kept is None:
            kept = self._tags[msg.tag] = _TagFrames(time.monotonic())
        kept.events.append(event)
        kept.nbytes += size
        self.nbytes += size

    def take(self, tag: str) -> list[tuple]:
        """The events kept for tag, in arrival order ([] if none); forgotten here."""
        kept = self._tags.pop(tag, None)
        if kept is None:
            return []
        self.nbytes -= kept.nbytes
        return kept.events

    def expire(self) -> None:
        """Forget the messages of tags that started no collective here within ttl_s seconds of
        their first message."""
        horizon = time.monotonic() - self.ttl_s
        while self._tags:
            tag, kept = next(iter(self._tags.items()))
            if kept.since >= horizon:
                break
            del self._tags[tag]
            self.nbytes -= kept.nbytes
            self.dropped += len(kept.events)
            self._log.warning("%s: dropped %d messages for tag %r: no collective with that tag started here "
                              "within %g s", self._where(), len(kept.events), tag, self.ttl_s)


class _TagFrames:
    """The messages kept for one tag, since its first arrived (monotonic s)."""

    __slots__ = ("since", "events", "nbytes")

    def __init__(self, since: float) -> None:
        self.since = since
        self.events: list[tuple] = []
        self.nbytes = 0
