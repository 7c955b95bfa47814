"""`LinkEndpoint`: the authenticated links of one transport, whatever carries their bytes.

It dials peers (with retries until a deadline, `connections_per_peer` streams each), accepts
streams under the admission guard's caps, runs the shared-secret handshake both ways, reads
messages off every authenticated stream into pooled buffers, answers bandwidth probes and counts
bytes. What the messages mean is its subclass's business (`transport.core.TransportBase`, the
collectives): it decides which payloads to receive (`_admit_data`), takes each data message
(`_deliver`) and hears of every lost stream (`_loss_listeners`).

A link type supplies the byte streams: `_open(peer, timeout_s)` returns a connected, socket-like
object (TLS already done where used), and for every accepted stream it calls
`_serve_connection(sock, ticket)` in a thread of its own. Socket-like means: recv, recv_into,
sendall, settimeout, shutdown, close.
"""

from __future__ import annotations

import collections
import itertools
import logging
import ssl
import threading
import time
from typing import Any, Callable, Mapping

import torch

from .auth import accept_handshake, dial_handshake
from .conn import Connection, Link, close_socket
from .errors import PeerAuthError, PeerDisconnected, TransportError, WireError
from .guard import (DEFAULT_HANDSHAKE_TIMEOUT_S, DEFAULT_MAX_UNAUTHENTICATED, DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE,
                    AdmissionGuard, Ticket)
from .identity import Credentials, as_credentials
from .link_probes import ProbingLinks, _PendingProbe
from .probe_turns import ProbeTurns
from .ratelog import RateLimitedLog
from .shaping import TokenBucket
from .wire import DATA_TYPES, BufferPool, MsgType, read_first_header, read_message

log = logging.getLogger("transport.core")  # one logger for the transport's messages, as before the split

# Free chunk buffers kept for reuse (see wire.BufferPool): enough for the chunks in flight of a
# 64 MiB all-reduce, so steady-state collectives allocate nothing per chunk.
_POOL_BYTES = 128 << 20


class LinkEndpoint(ProbingLinks):
    """Authenticated links to peers: dialing, accepting, reading messages, probes (``ProbingLinks``), counters."""

    def __init__(
        self,
        *,
        secret: "bytes | Credentials",
        timeout_s: float,
        connections_per_peer: int,
        max_message_bytes: int,
        shaper: TokenBucket | None,
        pin_memory: bool | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
        max_unauthenticated_per_source: int = DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE,
        dial_overrides: Mapping[str, str] | None = None,
    ) -> None:
        self._creds = as_credentials(secret)  # ValueError for empty bytes
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if connections_per_peer < 1:
            raise ValueError(f"connections_per_peer must be >= 1, got {connections_per_peer}")
        self.address = ""
        #: advertised peer address -> address actually dialed to reach it (e.g. a relay or a
        #: `FaultProxy`); peers are still named, and authenticated, by their advertised address.
        #: May be changed at any time; it applies to connections dialed afterwards.
        self.dial_overrides: dict[str, str] = dict(dial_overrides or {})
        #: the group this side proves in every handshake (None: a job-wide shared secret, no identity)
        self.group: int | None = self._creds.group
        self.timeout_s = float(timeout_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.connections_per_peer = connections_per_peer
        self.max_message_bytes = max_message_bytes
        self._shaper = shaper
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._bytes_sent = 0
        self._bytes_received = 0
        self._closed = False
        self._links: dict[str, Link] = {}
        self._dial_locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        # peer address -> {live connection id: the group it proved}
        self._incoming: dict[str, dict[int, int | None]] = collections.defaultdict(dict)
        self._conn_ids = itertools.count()
        self._incoming_socks: set[Any] = set()
        self._probes: dict[int, _PendingProbe] = {}
        self._probe_ids = itertools.count()
        self._probe_turns = ProbeTurns()  # the peers probing this end now
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA, which is not available")
        self._pool = BufferPool(_POOL_BYTES, pinned=pin_memory)
        self._flood_log = RateLimitedLog(log)  # warnings a peer can trigger at will
        self._guard = AdmissionGuard(handshake_timeout_s, max_unauthenticated, max_unauthenticated_per_source,
                                     on_tick=self._on_tick)

    # -- supplied by the link type ---------------------------------------------------------------
    def _open(self, peer: str, timeout_s: float, cancelled: Callable[[], str | None] | None = None) -> Any:
        """A connected socket-like stream to peer (TLS done, HMAC not yet), within `timeout_s`
        (a link type whose connecting waits may also stop once `cancelled()` gives a reason).
        Raises OSError."""
        raise NotImplementedError

    def _stop_listening(self) -> None:
        raise NotImplementedError

    def _on_authenticated(self, sock: Any) -> None:
        """Called once sock's handshake succeeded (either side), before any data message."""

    # -- supplied by the subclass: what the messages mean -------------------------------------------
    def _admit_data(self, peer: str, group: int | None, mtype: MsgType, tag: str, seg: int, chunk: int, aux: int,
                    nbytes: int) -> bool:
        """Whether to receive the payload of a data message or abort (see `_admit_payload`)."""
        raise NotImplementedError

    def _deliver(self, peer: str, conn_id: int, msg: Any, group: int | None) -> None:
        """Take one received data message or abort, from connection conn_id of peer (which proved group)."""
        raise NotImplementedError

    def _loss_listeners(self) -> list[Any]:
        """Whoever must hear of a lost incoming stream: objects with deliver(("lost", peer, conn_id,
        clean, reason, group, groups still open)). Called with self._lock held."""
        return []

    def _on_tick(self) -> None:
        """Housekeeping, called from the admission guard's thread about once a second."""

    # -- counters --------------------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        """Bytes of messages written so far (all peers, all collectives, handshakes included)."""
        with self._stats_lock:
            return self._bytes_sent

    @property
    def bytes_received(self) -> int:
        """Bytes of messages read so far (all peers, all collectives, handshakes included)."""
        with self._stats_lock:
            return self._bytes_received

    @property
    def rejected_connections(self) -> int:
        """Incoming connections refused at once: over the cap on unauthenticated connections
        (per listener or per source address)."""
        return self._guard.rejected

    @property
    def handshake_timeouts(self) -> int:
        """Incoming connections closed because they had not authenticated within handshake_timeout_s."""
        return self._guard.timed_out

    @property
    def unauthenticated_connections(self) -> int:
        """Incoming connections accepted and not yet authenticated, now."""
        return self._guard.live

    @property
    def max_unauthenticated_seen(self) -> int:
        """The most incoming connections from strangers (the shared slots, capped by
        max_unauthenticated) that were unauthenticated at one time."""
        return self._guard.peak

    @property
    def max_reserved_seen(self) -> int:
        """The most incoming connections from members' addresses (reserved slots) that were
        unauthenticated at one time."""
        return self._guard.peak_reserved

    @property
    def longest_unauthenticated_s(self) -> float:
        """The longest an incoming connection was held unauthenticated, admission to close (s)."""
        return self._guard.longest_s

    def _count_sent(self, n: int) -> None:
        with self._stats_lock:
            self._bytes_sent += n

    def _count_received(self, n: int) -> None:
        with self._stats_lock:
            self._bytes_received += n

    # -- links ---------------------------------------------------------------------------------------
    def connect(self, peer: str, timeout_s: float | None = None) -> None:
        """Open (or reuse) the authenticated link to `peer`. Raises PeerAuthError / TransportError."""
        self._get_link(peer, time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s))

    def _close_links(self, flush_timeout_s: float) -> None:
        """Stop listening, flush and close every link and incoming stream (self._closed already set)."""
        self._stop_listening()
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
            socks = list(self._incoming_socks)
        for link in links:
            link.close(flush_timeout_s)
        for s in socks:
            close_socket(s)
        self._pool.clear()
        self._guard.close()

    def _existing_link(self, peer: str) -> Link | None:
        with self._lock:
            return self._links.get(peer)

    def _incoming_count(self, peer: str, group: Any = "any") -> int:
        """Number of live authenticated connections from peer (that proved group, if given)."""
        with self._lock:
            conns = self._incoming.get(peer, {})
            return len(conns) if group == "any" else sum(1 for g in conns.values() if g == group)

    def _get_link(self, peer: str, deadline: float, cancelled: Callable[[], str | None] | None = None) -> Link:
        """The live link to peer, dialing (with retries until `deadline`, monotonic s) if needed.
        `cancelled()`: a reason to stop retrying (the collective that needs the link was aborted),
        or None to go on."""
        with self._lock:
            lock = self._dial_locks[peer]
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransportError(f"timed out waiting for another dial to {peer}")
        try:
            with self._lock:
                if self._closed:
                    raise TransportError("transport is closed")
                link = self._links.get(peer)
            if link is not None and link.alive:
                return link
            if link is not None:
                link.close(0.0)
            conns: list[Connection] = []
            try:
                for _ in range(self.connections_per_peer):
                    conns.append(self._dial(peer, deadline, cancelled))
            except BaseException:
                for c in conns:
                    c.close(0.0)
                raise
            if len({c.peer_group for c in conns}) > 1:
                for c in conns:
                    c.close(0.0)
                raise PeerAuthError(f"{peer}: its connections proved different groups "
                                    f"{sorted({str(c.peer_group) for c in conns})}")
            link = Link(peer, conns)
            with self._lock:
                if self._closed:
                    link.close(0.0)
                    raise TransportError("transport is closed")
                self._links[peer] = link
            return link
        finally:
            lock.release()

    def _dial(self, peer: str, deadline: float, cancelled: Callable[[], str | None] | None = None) -> Connection:
        """One authenticated connection to peer, retrying refused/reset attempts until deadline
        (or until `cancelled()` gives a reason)."""
        delay, last = 0.02, "no attempt"
        while True:
            why = cancelled() if cancelled is not None else None
            if why is not None:
                raise TransportError(f"stopped connecting to {peer}: {why} (last error: {last})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(f"could not connect to {peer} before the deadline (last error: {last})")
            sock = None
            try:
                sock = self._open(self.dial_overrides.get(peer, peer), min(remaining, 10.0), cancelled)
                sock.settimeout(min(max(remaining, 0.5), self.handshake_timeout_s))
                sent, peer_group = dial_handshake(sock, self._creds, self.address, peer, self._count_received)
                self._count_sent(sent)
                self._on_authenticated(sock)
                sock.settimeout(max(self.timeout_s, 1.0))  # bounds one blocked write
                return Connection(sock, peer, self._count_sent, self._shaper, peer_group=peer_group)
            except (PeerAuthError, WireError) as e:
                if sock is not None:
                    close_socket(sock)
                raise type(e)(f"{peer}: {e}") from e
            except ssl.SSLError as e:
                if sock is not None:
                    close_socket(sock)
                if isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
                    last = repr(e)  # the peer hung up during the TLS handshake: may be starting, retry
                else:  # a certificate or protocol mismatch does not heal by retrying
                    raise PeerAuthError(f"{peer}: TLS handshake failed: {e}") from e
            except (OSError, PeerDisconnected) as e:
                if sock is not None:
                    close_socket(sock)
                last = repr(e)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)

    # -- accepting side ----------------------------------------------------------------------------
    def _admit(self, source: str, closer: Any) -> Ticket | None:
        """A slot for a new incoming stream from source (an address without port), before any byte
        is read; None when over a cap on unauthenticated streams (the caller closes it at once).
        closer() ends the stream; it is called if the handshake deadline passes first."""
        ticket = self._guard.admit(source, closer)
        if ticket is None:
            self._flood_log.warning("refused", "%s: refused a connection from %s: too many unauthenticated connections "
                                    "(%d per listener, %d per source, %d per member address)", self.address, source,
                                    self._guard.max_unauthenticated, self._guard.max_per_source,
                                    self._guard.max_per_known_source)
        return ticket

    def _serve_connection(self, sock: Any, ticket: Ticket) -> None:
        """Authenticate one admitted stream, then dispatch its messages until it ends.

        The whole handshake must finish before ticket's deadline (`handshake_timeout_s` from
        admission); the guard closes the stream when it passes, however slowly bytes arrive."""
        with self._lock:
            if self._closed:
                self._guard.release(ticket)
                close_socket(sock)
                return
            self._incoming_socks.add(sock)
        try:
            try:
                sock.settimeout(self.handshake_timeout_s)
                peer, peer_group = accept_handshake(sock, self._creds, self._count_received, self._count_sent)
            except Exception as e:
                self._guard.release(ticket)  # no-op once expired
                if ticket.state != "expired":  # expiries: the guard writes one line per batch
                    self._flood_log.warning("handshake", "%s: rejected an incoming connection from %s: %s",
                                            self.address, ticket.source, e)
                return
            if not self._guard.authenticated(ticket):
                log.warning("%s: %s authenticated after the %g s handshake deadline; closed",
                            self.address, peer, self.handshake_timeout_s)
                return
            self._on_authenticated(sock)
            sock.settimeout(None)
            self._read_messages(sock, peer, peer_group)
        finally:
            with self._lock:
                self._incoming_socks.discard(sock)
            close_socket(sock)

    def _read_messages(self, sock: Any, peer: str, group: int | None = None) -> None:
        """Dispatch the data messages of an authenticated stream (from peer, which proved group)
        until it ends."""
        conn_id = next(self._conn_ids)
        with self._lock:
            self._incoming[peer][conn_id] = group
        reason, clean = "connection closed by peer", True
        admit = lambda *h: self._admit_payload(peer, group, *h)  # noqa: E731
        try:
            while True:
                first = read_first_header(sock, self._count_received)
                if not first:
                    break
                msg = read_message(sock, self.max_message_bytes, DATA_TYPES, self._count_received, first=first,
                                   alloc=self._pool.get, admit=admit)
                self._dispatch(peer, conn_id, msg, group)
        except Exception as e:  # garbage, truncation, reset, or our own close
            reason, clean = f"{type(e).__name__}: {e}", False
            if not self._closed:
                log.warning("%s: connection from %s failed: %s", self.address, peer, reason)
        with self._lock:
            self._incoming[peer].pop(conn_id, None)
            # The groups of this peer's connections still open now, when everything this one
            # carried is queued: the collective judges the loss by them, not by a later count
            # (by then the others may have closed too, their last data still queued behind this).
            still_open = tuple(self._incoming[peer].values())
            if not still_open:
                del self._incoming[peer]
                self._probe_turns.gone(peer)
                for pending in self._probes.values():  # their answers would have come over these
                    if pending.peer == peer and not pending.answered:
                        pending.lost = reason
                        pending.done.set()
            listeners = self._loss_listeners()
        for op in listeners:
            op.deliver(("lost", peer, conn_id, clean, reason, group, still_open))

    def _admit_payload(self, peer: str, group: int | None, mtype: MsgType, tag: str, seg: int, chunk: int, aux: int,
                       nbytes: int) -> bool:
        """Check a message's payload length against what this side expects, before any byte of it
        is allocated. True: receive it; False: read and discard it (the message is still
        dispatched, with an empty payload); WireError: the length cannot be right (the
        connection is closed)."""
        if mtype == MsgType.PROBE:
            return False  # filler: only its arrival matters
        if mtype == MsgType.PROBE_ACK:
            if nbytes:
                raise WireError(f"PROBE_ACK from {peer} carries {nbytes} payload bytes, want 0")
            return True
        return self._admit_data(peer, group, mtype, tag, seg, chunk, aux, nbytes)

    def _dispatch(self, peer: str, conn_id: int, msg, group: int | None = None) -> None:
        if msg.type in (MsgType.PROBE, MsgType.PROBE_ACK):
            self._on_probe(peer, msg, group)
            return
        self._deliver(peer, conn_id, msg, group)
