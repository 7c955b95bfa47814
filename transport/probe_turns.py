"""Whose turn it is to probe, when the two ends of a link probe each other at once.

Groups probe each other as they start (and at every re-probe), so both ends of a link usually
probe it at the same moment. Then a tiny round trip's answer queues behind the other end's big
probe, and either end misreads the link (a token-bucket link was read 25x too fast, a 0.5 Mbit/s
tbf link 0.6-10.6 Mbit/s). So the two take turns, without a third party:

* a probe says where it starts and ends: its first message (the warm-up) carries ``BEGIN`` in the
  PROBE header's ``chunk`` field and its last one ``END`` (the timed ones carry ``MEASURE``); each
  end notes which peers are probing it now (``heard``);
* of two ends probing each other, the one with the larger address gives way (``gives_way``): it
  checks before each timed round trip, and when the other is probing it sends ``END``, waits
  for the other's ``END`` (``wait_quiet``) and starts over; the other end, after its warm-up,
  waits for the ``END`` of a probe it found running, which then comes within one round trip.

Both ends agree on who gives way from the addresses alone. Every wait is bounded (a peer lost
mid-probe never sends its ``END``; its connections closing clears it, ``gone``). A peer that
sends no markers (an older build) is never waited for: the probes then overlap as before.
"""

from __future__ import annotations

import threading
import time

#: the PROBE header's ``chunk``: a probe's warm-up, its timed round trips, its last message
BEGIN, MEASURE, END = 1, 0, 2


def gives_way(me: str, peer: str) -> bool:
    """Whether ``me`` waits for ``peer`` when both probe each other (both ends compute the same)."""
    return me > peer


class ProbeTurns:
    """The peers probing this end now (between their ``BEGIN`` and ``END``). Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._probing: set[str] = set()

    def heard(self, peer: str, chunk: int) -> None:
        """A PROBE message from ``peer`` arrived, with ``chunk`` (``BEGIN``, ``MEASURE``, ``END``)."""
        with self._cond:
            if chunk == BEGIN:
                self._probing.add(peer)
            elif chunk == END:
                self._probing.discard(peer)
            else:
                return
            self._cond.notify_all()

    def gone(self, peer: str) -> None:
        """Every connection from ``peer`` closed: a probe of it that did not end never will."""
        self.heard(peer, END)

    def probing(self, peer: str) -> bool:
        """Whether ``peer`` is probing this end now."""
        with self._cond:
            return peer in self._probing

    def wait_quiet(self, peer: str, until: float) -> bool:
        """Wait while ``peer`` probes this end, until ``until`` (``time.monotonic`` s) at the
        latest; True once it is not probing."""
        with self._cond:
            while peer in self._probing:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True
