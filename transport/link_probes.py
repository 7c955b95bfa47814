"""Bandwidth probes over a ``LinkEndpoint``'s authenticated links: a probe times an nbytes
message against a tiny one, both to the peer's acknowledgement, and the peer answers; two ends
probing each other take turns (``probe_turns``). ``ProbingLinks`` is a part of ``LinkEndpoint``
(its base), kept here: it uses the endpoint's links (``_get_link``), lock and probe table.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from .conn import Link
from .errors import PeerAuthError, TransportError
from .probe import PROBE_MIN_TRANSFER_S, PROBE_PAIRS, ProbeError, probe_rate
from .probe_turns import BEGIN, END, MEASURE, gives_way
from .wire import MsgType, pack_header

log = logging.getLogger("transport.core")  # the transport's one logger (transport.links)

#: a probe not acknowledged within this many seconds is sent again (see _probe_roundtrip)
PROBE_RESEND_S = 2.0


class _Unanswered(TransportError):
    """A probe needed resending: its timing measures the wait, not the link."""


class _GaveWay(TransportError):
    """The peer probes this end too, and this end gives way (``transport.probe_turns``)."""


@dataclasses.dataclass
class _PendingProbe:
    """A probe sent and not yet answered: ``done`` is set by its answer (``answered``), or when
    every connection from ``peer`` closed (``lost``: the answer would come over one of them)."""

    peer: str
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    answered: bool = False
    lost: str = ""


class ProbingLinks:
    """``LinkEndpoint``'s probes: ``probe`` measures a peer, ``_on_probe`` answers one."""

    def probe(self, peer: str, nbytes: int = 8 << 20, timeout_s: float | None = None) -> float:
        """Measured bandwidth to peer in bytes/s: time of an nbytes message minus that of a tiny one.

        Both are timed from send to the peer's acknowledgement, so the round trip cancels out; a
        warm-up round trip first (a dial or redial), then ``PROBE_PAIRS`` pairs of (tiny, big), and
        `transport.probe.probe_rate` takes the median of their differences. When that is shorter
        than ``PROBE_MIN_TRANSFER_S`` (a fast link, or timings swamped by noise) the probe is
        repeated with 4x the bytes, up to 16x nbytes (within max_message_bytes); if even that is too
        short to time, the measured time is floored at ``PROBE_MIN_TRANSFER_S`` (the rate reported is
        then a lower bound, and a warning says so). ProbeError for a rate above any link's, never an
        impossible one. Probe one peer at a time: probes running at once share this host's link.
        When the peer probes this end at the same time, the two take turns (``transport.probe_turns``).
        """
        if nbytes < 1 or nbytes + 4096 > self.max_message_bytes:
            raise ValueError(f"nbytes must be in [1, max_message_bytes - 4096], got {nbytes}")
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        most = max(nbytes, min(16 * nbytes, self.max_message_bytes - 4096))
        size = nbytes
        turns, yields = self._probe_turns, gives_way(self.address, peer)

        def await_turn() -> None:  # the peer's probe of this end ends; at most half the time left
            if not turns.wait_quiet(peer, time.monotonic() + (deadline - time.monotonic()) / 2):
                log.warning("%s: %s's probe of this end did not end within half of this probe's time; measuring "
                            "anyway (the two probes overlap: this rate may be misread)", self.address, peer)

        while True:
            link = self._get_link(peer, deadline)
            await_turn()
            try:
                try:
                    self._probe_roundtrip(link, 1, deadline, resend=True, chunk=BEGIN)  # warm-up
                    if not yields:  # a probe of this end that was running gives way within its round trip
                        await_turn()
                    pairs = []
                    for _ in range(PROBE_PAIRS):
                        if yields and turns.probing(peer):
                            raise _GaveWay(peer)
                        pairs.append((self._probe_roundtrip(link, 1, deadline),
                                      self._probe_roundtrip(link, size, deadline)))
                finally:
                    self._probe_end(link)
            except (_Unanswered, _GaveWay):  # measured again: on a link known good both ways, after the peer's turn
                continue
            try:
                rate = probe_rate(size, pairs)
            except ProbeError as e:
                raise ProbeError(f"probe to {peer}: {e}") from None
            if rate is not None:
                return rate
            if size >= most:  # faster than this size can time, or noise: the floor's rate, a lower bound
                shown = ", ".join(f"{s * 1e6:.0f}/{b * 1e6:.0f}" for s, b in pairs)
                log.warning("%s: probe to %s: %d B took no measurable time over a tiny message (us tiny/big: %s); "
                            "reporting %.3g B/s, the rate of the %.0f us floor", self.address, peer, size, shown,
                            size / PROBE_MIN_TRANSFER_S, PROBE_MIN_TRANSFER_S * 1e6)
                return size / PROBE_MIN_TRANSFER_S
            size = min(4 * size, most)

    def _probe_end(self, link: Link) -> None:
        """Tell the peer that this end's probe of it ended (``probe_turns.END``); nothing awaited."""
        with self._lock:
            pid = next(self._probe_ids)
        link.send([pack_header(MsgType.PROBE, b"", pid, END, 0, 1), bytes(1)], None)  # never raises

    def _probe_roundtrip(self, link: Link, nbytes: int, deadline: float, *, resend: bool = False,
                         chunk: int = MEASURE) -> float:
        """Seconds from sending an nbytes probe to its acknowledgement. When none comes within
        PROBE_RESEND_S and ``resend`` (the warm-up) the probe is sent again (the peer's way back may
        have been a stale link to an earlier process at this address: answering on it fails, and the
        peer redials), and _Unanswered tells the caller that this timing is not a measurement. The
        measured round trips wait for their answer until the deadline: once the warm-up was answered
        the way back is good, and on a slow link a big probe, or a tiny one queued behind the peer's
        own big probe, takes longer than PROBE_RESEND_S by itself (at 2 Mbit/s 512 KiB take 2.1 s):
        sending it again would flood the link it measures and start the measurement over. A probe
        whose peer closed every connection to this end meanwhile (its process ended) gets no answer
        either: _Unanswered at once, and the caller's next warm-up, sent over the link to the process
        that ended, fails within its resend interval (TransportError) instead of at the deadline."""
        with self._lock:
            pid = next(self._probe_ids)
            pending = self._probes[pid] = _PendingProbe(link.peer)
            done = pending.done
        try:
            head = pack_header(MsgType.PROBE, b"", pid, chunk, 0, nbytes)
            failed: list[str] = []
            start = time.perf_counter()
            link.send([head, bytes(nbytes)], lambda reason: (failed.append(reason), done.set()))
            resent = False
            wait_s = PROBE_RESEND_S if resend else float("inf")
            while not done.wait(max(0.0, min(wait_s, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TransportError(f"probe to {link.peer} timed out")
                resent = True
                link.send([head, bytes(nbytes)], lambda reason: (failed.append(reason), done.set()))
            if failed:
                raise TransportError(f"probe to {link.peer} failed: {failed[0]}")
            if resent or not pending.answered:  # resent, or every connection from the peer closed
                raise _Unanswered(link.peer)
            return time.perf_counter() - start
        finally:
            with self._lock:
                self._probes.pop(pid, None)

    def _on_probe(self, peer: str, msg, group: int | None = None) -> None:
        if msg.type == MsgType.PROBE_ACK:
            with self._lock:
                pending = self._probes.get(msg.seg)
                if pending is not None:
                    pending.answered = True
            if pending is not None:
                pending.done.set()
            return
        self._probe_turns.heard(peer, msg.chunk)

        def answer() -> None:
            deadline = time.monotonic() + self.timeout_s
            try:
                for _ in range(2):  # a link to an earlier process at peer's address fails: redial once
                    link = self._get_link(peer, deadline)
                    if link.peer_group != group:  # answer only the group that asked, not whoever its address is
                        raise PeerAuthError(f"the probe came from group {group}, {peer} proved group {link.peer_group}")
                    settled, failed = threading.Event(), []
                    link.send([pack_header(MsgType.PROBE_ACK, b"", msg.seg, 0, 0, 0)],
                              lambda reason: (failed.append(reason), settled.set()), settled.set)
                    settled.wait(max(0.0, deadline - time.monotonic()))
                    if not failed:
                        return
                raise TransportError(failed[0])
            except Exception as e:
                log.warning("%s: could not answer a probe from %s: %s", self.address, peer, e)

        threading.Thread(target=answer, name="probe-ack", daemon=True).start()
