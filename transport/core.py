"""`TransportBase`: what every link type shares -- collectives, dispatch by tag, dialing, counters.

A subclass supplies the byte streams: `_open(peer, timeout_s)` returns a connected, socket-like
object (TLS already done where used), and for every accepted stream it calls
`_serve_connection(sock)` in a thread of its own. Socket-like means: recv, recv_into, sendall,
settimeout, shutdown, close. The shared-secret handshake, the message format, the dispatch of
messages to collectives and the collectives themselves are the same for every link type.
"""

from __future__ import annotations

import collections
import itertools
import logging
import ssl
import threading
import time
from typing import Any, Mapping

import torch

from .auth import accept_handshake, dial_handshake
from .conn import Connection, Link, close_socket
from .errors import PeerAuthError, PeerDisconnected, TransportError, WireError
from .identity import Credentials, as_credentials
from .guard import (DEFAULT_HANDSHAKE_TIMEOUT_S, DEFAULT_MAX_UNAUTHENTICATED, DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE,
                    AdmissionGuard, Ticket)
from .ratelog import RateLimitedLog
from .frames import default_codec
from .gather import RingAllGather, check_scales, reduce_in_order
from .outputs import check_out, overlaps
from .pending import DEFAULT_MAX_PENDING_BYTES, DEFAULT_PENDING_TTL_TIMEOUTS, PendingFrames
from .ring import Handle, RingAllReduce
from .shaping import TokenBucket
from .streams import side_stream_for
from .wire import DATA_TYPES, BufferPool, MsgType, pack_header, read_first_header, read_message

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20  # measured: best of 64 KiB..4 MiB on loopback, see bench/README.md
_FINISHED_TAGS_KEPT = 10_000
_MAX_ABORT_BYTES = 4096  # an ABORT carries a reason of at most 4000 UTF-8 bytes
# Free chunk buffers kept for reuse (see wire.BufferPool): enough for the chunks in flight of a
# 64 MiB all-reduce, so steady-state collectives allocate nothing per chunk.
_POOL_BYTES = 128 << 20


class TransportBase:
    """Collectives over authenticated links; see `TcpTransport` for the parameters."""

    def __init__(
        self,
        *,
        secret: "bytes | Credentials",
        timeout_s: float,
        chunk_bytes: int,
        connections_per_peer: int,
        max_message_bytes: int,
        shaper: TokenBucket | None,
        pin_memory: bool | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
        max_unauthenticated_per_source: int = DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        pending_ttl_s: float | None = None,
        dial_overrides: Mapping[str, str] | None = None,
    ) -> None:
        self._creds = as_credentials(secret)  # ValueError for empty bytes
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if chunk_bytes < 4:
            raise ValueError(f"chunk_bytes must be >= 4, got {chunk_bytes}")
        if chunk_bytes * 2 + 4096 > max_message_bytes:
            raise ValueError("max_message_bytes must exceed 2 * chunk_bytes + 4096")
        if connections_per_peer < 1:
            raise ValueError(f"connections_per_peer must be >= 1, got {connections_per_peer}")
        if max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes must be >= 0, got {max_pending_bytes}")
        if pending_ttl_s is None:
            pending_ttl_s = DEFAULT_PENDING_TTL_TIMEOUTS * timeout_s
        if pending_ttl_s <= 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {pending_ttl_s}")
        self.address = ""
        #: advertised peer address -> address actually dialed to reach it (e.g. a relay or a
        #: `FaultProxy`); peers are still named, and authenticated, by their advertised address.
        #: May be changed at any time; it applies to connections dialed afterwards.
        self.dial_overrides: dict[str, str] = dict(dial_overrides or {})
        #: the group this side proves in every handshake (None: a job-wide shared secret, no identity)
        self.group: int | None = self._creds.group
        self.timeout_s = float(timeout_s)
        self.chunk_elems = chunk_bytes // 4
        # Largest frame of one chunk under any codec (8 bytes per value: fp32 values and indices).
        self.max_chunk_frame_bytes = 2 * chunk_bytes + 4096
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.connections_per_peer = connections_per_peer
        self.max_message_bytes = max_message_bytes
        self._shaper = shaper
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._bytes_sent = 0
        self._bytes_received = 0
        self._ignored_messages = 0
        self._closed = False
        self._ops: dict[str, RingAllReduce] = {}
        self._pending = PendingFrames(int(max_pending_bytes), float(pending_ttl_s), log, lambda: self.address)
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._links: dict[str, Link] = {}
        self._dial_locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        # peer address -> {live connection id: the group it proved}
        self._incoming: dict[str, dict[int, int | None]] = collections.defaultdict(dict)
        self._conn_ids = itertools.count()
        self._incoming_socks: set[Any] = set()
        self._probes: dict[int, threading.Event] = {}
        self._probe_ids = itertools.count()
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA, which is not available")
        self._pool = BufferPool(_POOL_BYTES, pinned=pin_memory)
        self._flood_log = RateLimitedLog(log)  # warnings a peer can trigger at will
        self._guard = AdmissionGuard(handshake_timeout_s, max_unauthenticated, max_unauthenticated_per_source,
                                     on_tick=self._expire_pending_now)

    # -- supplied by the link type ---------------------------------------------------------------
    def _open(self, peer: str, timeout_s: float) -> Any:
        """A connected socket-like stream to peer (TLS done, HMAC not yet). Raises OSError."""
        raise NotImplementedError

    def _stop_listening(self) -> None:
        raise NotImplementedError

    def _on_authenticated(self, sock: Any) -> None:
        """Called once sock's handshake succeeded (either side), before any data message."""

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

    @property
    def ignored_messages(self) -> int:
        """Data messages and aborts dropped because they did not come from the collective's left
        neighbour (by address and, with group credentials, by proved group)."""
        with self._stats_lock:
            return self._ignored_messages

    @property
    def max_pending_bytes(self) -> int:
        """Bound, in bytes, on messages buffered for collectives that have not started here."""
        return self._pending.max_bytes

    @property
    def pending_ttl_s(self) -> float:
        """Seconds the messages of a tag that starts no collective here are kept after its first."""
        return self._pending.ttl_s

    @property
    def pending_bytes(self) -> int:
        """Bytes buffered now for collectives that have not started here (at most max_pending_bytes)."""
        with self._lock:
            return self._pending.nbytes

    @property
    def dropped_pending_messages(self) -> int:
        """Messages for not-yet-started collectives dropped: over max_pending_bytes or past pending_ttl_s."""
        with self._lock:
            return self._pending.dropped

    def _count_sent(self, n: int) -> None:
        with self._stats_lock:
            self._bytes_sent += n

    def _count_received(self, n: int) -> None:
        with self._stats_lock:
            self._bytes_received += n

    # -- public API ----------------------------------------------------------------------------
    def all_reduce(
        self,
        x: torch.Tensor,
        ring: list[str],
        index: int,
        *,
        tag: str,
        codec: Any = None,
        timeout_s: float | None = None,
        out: torch.Tensor | None = None,
        groups: list[int] | None = None,
        finite: bool = False,
    ) -> Handle:
        """Start a ring all-reduce of the 1-D float32 tensor x; `Handle.wait()` gives the mean.

        ring: peer addresses in ring order, ring[index] == self.address. tag: unique id of this
        collective, the same on every member. codec: a `compress` codec (default fp32), the same
        on every member. timeout_s: deadline in seconds for connecting and for each wait without
        progress (default: the transport's). x is only read, never written, and must not change
        until the collective ends. out: where to write the mean (float32, x's shape; not
        overlapping x): reusing one saves allocating (and page-faulting) a result each time;
        after a failed collective its contents are undefined.
        x may live on a GPU: each chunk is then decoded, summed and encoded there, only encoded
        frames cross to the host (received into pinned buffers, see `pin_memory`), and the
        mean is on x's device.
        Tags must not be reused: messages for a tag that finished here recently are dropped.
        groups: the group of each ring member (groups[i] is ring[i]'s), as the membership says.
        With group credentials (see `transport.identity`) the collective then sends only to a
        right neighbour that proved groups[index + 1] and takes data and aborts only from
        connections that proved groups[index - 1] from its left neighbour's address; anything
        else is read, dropped and counted (`ignored_messages`). Without groups it trusts the
        address a peer claims (any holder of the credentials can claim any address).
        finite: refuse (abort on) a received frame that holds NaN or Inf: for vectors that are
        finite by construction, so a broken or hostile neighbour cannot slip them in.
        """
        groups, codec, timeout = self._check_collective(x, ring, index, codec, timeout_s, out, groups)
        xs = x.detach().contiguous()  # stays on its device: a GPU tensor is encoded on the GPU
        if len(ring) == 1 or x.numel() == 0:
            h = Handle(tag)
            mean = torch.empty(0, device=x.device) if x.numel() == 0 else codec.encode_with_decoded(xs)[1].reshape(-1)
            h._finish(out.copy_(mean) if out is not None else mean, None)
            return h
        op = RingAllReduce(self, xs, list(ring), index, tag, codec, timeout, self.chunk_elems, out=out,
                           stream=side_stream_for(xs), groups=groups if self.group is not None else None, finite=finite)
        return self._start(op)

    def all_gather_mean(
        self,
        x: torch.Tensor,
        ring: list[str],
        index: int,
        *,
        tag: str,
        codec: Any = None,
        timeout_s: float | None = None,
        out: torch.Tensor | None = None,
        sent: torch.Tensor | None = None,
        groups: list[int] | None = None,
        finite: bool = False,
        scales: list[float] | None = None,
    ) -> Handle:
        """Start a ring all-gather of every member's own encoded x; `Handle.wait()` gives the mean
        of the decoded contributions, bit-identical on every member (see `transport.gather`).

        Unlike `all_reduce`, each member's x is encoded once, by that member, and never re-encoded,
        so a member knows exactly what the others received of it: `Handle.sent` (or `sent`, a
        float32 buffer of x's shape not overlapping x or out) holds those decoded values once
        wait() returned -- what error feedback needs. scales: one weight >= 0 per ring member
        (ring-index order, the same list on every member); the result is then
        sum(scales[i] * decoded_i) / G. The other arguments are those of `all_reduce`.
        """
        groups, codec, timeout = self._check_collective(x, ring, index, codec, timeout_s, out, groups)
        scales = check_scales(scales, len(ring))
        if sent is not None:
            check_out(sent, x)
            if out is not None and overlaps(sent, out):
                raise ValueError("sent must not overlap out")
        xs = x.detach().contiguous()
        if len(ring) == 1 or x.numel() == 0:
            h = Handle(tag)
            mine = codec.encode_with_decoded(xs)[1].reshape(-1) if x.numel() else torch.empty(0, device=x.device)
            h.sent = sent.copy_(mine) if sent is not None else mine
            result = out if out is not None else torch.empty_like(mine)
            h._finish(reduce_in_order([h.sent], scales, result), None)
            return h
        op = RingAllGather(self, xs, list(ring), index, tag, codec, timeout, self.chunk_elems, out=out, sent=sent,
                           stream=side_stream_for(xs), groups=groups if self.group is not None else None, finite=finite,
                           scales=scales)
        return self._start(op)

    def _check_collective(self, x: torch.Tensor, ring: list[str], index: int, codec: Any, timeout_s: float | None,
                          out: torch.Tensor | None, groups: list[int] | None) -> tuple[list[int] | None, Any, float]:
        """Validate a collective's arguments; returns (groups, codec, timeout_s) with defaults filled in."""
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32:
            raise ValueError(f"x must be a 1-D float32 tensor, got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
        if not ring or not 0 <= index < len(ring):
            raise ValueError(f"index {index} out of range for a ring of {len(ring)}")
        if ring[index] != self.address:
            raise ValueError(f"ring[{index}] = {ring[index]!r} is not this transport's address {self.address!r}")
        if len(set(ring)) != len(ring):
            raise ValueError(f"ring has duplicate addresses: {ring}")
        if groups is not None:
            groups = [int(g) for g in groups]
            if len(groups) != len(ring):
                raise ValueError(f"groups has {len(groups)} entries for a ring of {len(ring)}")
            if self.group is not None and groups[index] != self.group:
                raise ValueError(f"groups[{index}] = {groups[index]} is not this transport's group {self.group}")
        for peer in ring:  # members: their connections take reserved slots (transport.guard)
            if peer != self.address:
                self._guard.know(peer.rpartition(":")[0].strip("[]"))
        if codec is None:
            codec = default_codec()
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if timeout <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if out is not None:
            check_out(out, x)
        return groups, codec, timeout

    def _start(self, op: RingAllReduce) -> Handle:
        """Register a collective under its tag, hand it the messages that arrived before it
        started, and run it in a thread of its own."""
        tag = op.tag
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            if tag in self._ops:
                raise ValueError(f"a collective with tag {tag!r} is already running")
            self._finished.pop(tag, None)
            self._ops[tag] = op
            live = {c for c, g in self._incoming.get(op.left, {}).items() if op.from_left(op.left, g)}
            op.watch = set(live)
            gone = set()
            for ev in self._pending.take(tag):
                op.deliver(ev)
                if ev[0] == "msg" and ev[2] not in self._incoming.get(ev[1], {}):
                    gone.add((ev[1], ev[2], ev[4]))
            for peer, conn_id, group in gone:  # those connections closed before this collective started
                op.deliver(("lost", peer, conn_id, True, "connection closed before this collective started", group,
                            tuple(self._incoming.get(peer, {}).values())))
        threading.Thread(target=op.run, name=f"{op.kind}[{tag}]", daemon=True).start()
        return op.handle

    def connect(self, peer: str, timeout_s: float | None = None) -> None:
        """Open (or reuse) the authenticated link to `peer`. Raises PeerAuthError / TransportError."""
        self._get_link(peer, time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s))

    def probe(self, peer: str, nbytes: int = 8 << 20, timeout_s: float | None = None) -> float:
        """Measured bandwidth to peer in bytes/s: time of an nbytes message minus that of a tiny one.

        Both are timed from send to the peer's acknowledgement, so the round trip cancels out.
        Probe one peer at a time: probes running at once share this host's link.
        """
        if nbytes < 1 or nbytes + 4096 > self.max_message_bytes:
            raise ValueError(f"nbytes must be in [1, max_message_bytes - 4096], got {nbytes}")
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        link = self._get_link(peer, deadline)
        self._probe_roundtrip(link, 1, deadline)  # warm-up
        small = min(self._probe_roundtrip(link, 1, deadline) for _ in range(2))
        big = self._probe_roundtrip(link, nbytes, deadline)
        return nbytes / max(big - small, 1e-9)

    def _probe_roundtrip(self, link: Link, nbytes: int, deadline: float) -> float:
        with self._lock:
            pid = next(self._probe_ids)
            done = threading.Event()
            self._probes[pid] = done
        try:
            head = pack_header(MsgType.PROBE, b"", pid, 0, 0, nbytes)
            failed: list[str] = []
            start = time.perf_counter()
            link.send([head, bytes(nbytes)], lambda reason: (failed.append(reason), done.set()))
            if not done.wait(max(0.0, deadline - time.monotonic())):
                raise TransportError(f"probe to {link.peer} timed out")
            if failed:
                raise TransportError(f"probe to {link.peer} failed: {failed[0]}")
            return time.perf_counter() - start
        finally:
            with self._lock:
                self._probes.pop(pid, None)

    def _on_probe(self, peer: str, msg, group: int | None = None) -> None:
        if msg.type == MsgType.PROBE_ACK:
            with self._lock:
                done = self._probes.get(msg.seg)
            if done is not None:
                done.set()
            return

        def answer() -> None:
            try:
                link = self._get_link(peer, time.monotonic() + self.timeout_s)
                if link.peer_group != group:  # answer only the group that asked, not whoever its address is
                    raise PeerAuthError(f"the probe came from group {group}, {peer} proved group {link.peer_group}")
                link.send([pack_header(MsgType.PROBE_ACK, b"", msg.seg, 0, 0, 0)], None)
            except Exception as e:
                log.warning("%s: could not answer a probe from %s: %s", self.address, peer, e)

        threading.Thread(target=answer, name="probe-ack", daemon=True).start()

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Abort running collectives, flush queued sends (up to flush_timeout_s), close everything."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ops = list(self._ops.values())
        for op in ops:
            op.abort("transport closed")
        for op in ops:
            op.handle._event.wait(2.0)
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

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by collectives -----------------------------------------------------------------------
    def _existing_link(self, peer: str) -> Link | None:
        with self._lock:
            return self._links.get(peer)

    def _incoming_count(self, peer: str, group: Any = "any") -> int:
        """Number of live authenticated connections from peer (that proved group, if given)."""
        with self._lock:
            conns = self._incoming.get(peer, {})
            return len(conns) if group == "any" else sum(1 for g in conns.values() if g == group)

    def _unregister(self, tag: str, op: RingAllReduce) -> None:
        with self._lock:
            if self._ops.get(tag) is op:
                del self._ops[tag]
            self._finished[tag] = None
            while len(self._finished) > _FINISHED_TAGS_KEPT:
                self._finished.popitem(last=False)

    def _get_link(self, peer: str, deadline: float) -> Link:
        """The live link to peer, dialing (with retries until `deadline`, monotonic s) if needed."""
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
                    conns.append(self._dial(peer, deadline))
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

    def _dial(self, peer: str, deadline: float) -> Connection:
        """One authenticated connection to peer, retrying refused/reset attempts until deadline."""
        delay, last = 0.02, "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(f"could not connect to {peer} before the deadline (last error: {last})")
            sock = None
            try:
                sock = self._open(self.dial_overrides.get(peer, peer), min(remaining, 10.0))
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
            ops = list(self._ops.values())
        for op in ops:
            op.deliver(("lost", peer, conn_id, clean, reason, group, still_open))

    def _admit_payload(self, peer: str, group: int | None, mtype: MsgType, tag: str, seg: int, chunk: int, aux: int,
                       nbytes: int) -> bool:
        """Check a data message's payload length against what this side expects, before any byte
        of it is allocated. True: receive it; False: read and discard it (the message is still
        dispatched, with an empty payload); WireError: the length cannot be right (the
        connection is closed)."""
        if mtype == MsgType.PROBE:
            return False  # filler: only its arrival matters
        if mtype == MsgType.PROBE_ACK:
            if nbytes:
                raise WireError(f"PROBE_ACK from {peer} carries {nbytes} payload bytes, want 0")
            return True
        if mtype == MsgType.ABORT:
            if nbytes > _MAX_ABORT_BYTES:
                raise WireError(f"ABORT for tag {tag!r} from {peer} carries {nbytes} bytes, at most {_MAX_ABORT_BYTES}")
            return True
        with self._lock:
            op = self._ops.get(tag)
            if op is None:
                return self._admit_pending(peer, mtype, tag, nbytes)
        if not op.from_left(peer, group):
            return False  # not this collective's left neighbour: dropped unread (the collective counts it)
        limit = op.max_frame_bytes(seg, chunk, aux)
        if limit is None:
            return False  # not a chunk of this collective: the collective aborts on it, unread
        if nbytes > limit:
            raise WireError(f"{mtype.name} chunk {(seg, chunk)} of tag {tag!r} from {peer} announces {nbytes} "
                            f"payload bytes, at most {limit} expected for that chunk")
        return True

    def _admit_pending(self, peer: str, mtype: MsgType, tag: str, nbytes: int) -> bool:
        """_admit_payload for a tag with no running collective here (caller holds the lock)."""
        if nbytes > self.max_chunk_frame_bytes:
            raise WireError(f"{mtype.name} for tag {tag!r} from {peer} announces {nbytes} payload bytes, more "
                            f"than the largest chunk frame ({self.max_chunk_frame_bytes} bytes for chunk_bytes="
                            f"{4 * self.chunk_elems})")
        if tag in self._finished:
            return False
        return self._pending.fits(nbytes)

    def _expire_pending_now(self) -> None:
        with self._lock:
            self._pending.expire()

    def _dispatch(self, peer: str, conn_id: int, msg, group: int | None = None) -> None:
        if msg.type in (MsgType.PROBE, MsgType.PROBE_ACK):
            self._on_probe(peer, msg, group)
            return
        ev = ("msg", peer, conn_id, msg, group)
        with self._lock:
            op = self._ops.get(msg.tag)
            if op is None:
                if msg.tag not in self._finished:
                    self._pending.add(peer, msg, ev)
                return
        op.deliver(ev)
