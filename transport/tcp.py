"""`TcpTransport`: links over plain TCP sockets, optionally inside mutual TLS.

It listens at once (a background accept thread); each accepted connection gets a thread that
does TLS (if configured), the shared-secret handshake, then reads messages. Outgoing connections
are dialed lazily and kept (see `TransportBase`).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable

from .addresses import check_plaintext, split_address
from .conn import close_socket
from .core import TransportBase
from .guard import Ticket
from .tls import TlsConfig

log = logging.getLogger(__name__)

_MAX_INCOMING = 1024


class TcpTransport(TransportBase):
    """Collectives over TCP (see `TransportBase.all_reduce`).

    host/port: where to listen (port 0 = ephemeral); `address` is the real "host:port".
    secret: the credentials of the mutual HMAC handshake: bytes (a job-wide shared secret, every
    peer holds the same one, nobody has a group identity) or this group's `transport.identity.
    GroupKeys` (the handshake then proves each side's group; rings given `groups=` check them).
    timeout_s: default deadline in seconds for connecting and for each wait without progress.
    chunk_bytes: pipelining unit, in bytes of fp32 input per chunk (same on every peer).
    connections_per_peer: TCP connections opened to each peer; chunks are spread across them.
    max_message_bytes: largest payload accepted from a peer (checked before allocating).
    shaper: optional token bucket limiting this transport's total send rate (tests, benchmarks).
    tls: mutual TLS settings. Without it, plain text is used only on a loopback host or when
    allow_plaintext=True is passed explicitly.
    advertise: address announced to peers instead of "host:port" (e.g. when host is 0.0.0.0).
    dial_overrides: {peer's advertised address: address to dial instead} (a relay, a tunnel, a
    `FaultProxy` in tests); the peer is still named and authenticated by its advertised address.
    pin_memory: receive frames into page-locked buffers, for collectives on GPU tensors
    (default: when CUDA is available).

    Hostile peers (see transport/guard.py):
    handshake_timeout_s: seconds from accepting a connection until it must have finished TLS and
    the shared-secret handshake (default 10); it is closed then, however slowly bytes arrive.
    max_unauthenticated: connections allowed to be unauthenticated at once on this listener
    (default 64); max_unauthenticated_per_source: of those, from one source address (default 8).
    Over a cap a new connection is closed at once; authenticated connections never count.
    max_pending_bytes: bound on frames buffered for collectives not yet started here (default
    256 MiB); pending_ttl_s: seconds such frames are kept (default 2 * timeout_s). Frames beyond
    either are dropped (read and thrown away, never allocated).
    Counters: `rejected_connections`, `handshake_timeouts`, `unauthenticated_connections`,
    `pending_bytes`, `dropped_pending_messages`.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tls: TlsConfig | None = None,
        allow_plaintext: bool = False,
        advertise: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)  # secret, timeouts, chunking and the guards: TransportBase's keywords
        try:
            check_plaintext("TCP", host, tls, allow_plaintext)
            self._server_ctx: ssl.SSLContext | None = tls.server_context() if tls else None
            self._client_ctx: ssl.SSLContext | None = tls.client_context() if tls else None
            self._incoming_slots = threading.BoundedSemaphore(_MAX_INCOMING)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, port), family=family, backlog=128)
            self._listener.settimeout(0.2)
            bound_port = self._listener.getsockname()[1]
            self.address = advertise or (f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}")
            self._guard.name = self.address
            self._accept_thread = threading.Thread(target=self._accept_loop, name=f"accept@{self.address}", daemon=True)
            self._accept_thread.start()
        except BaseException:
            self._guard.close()  # the deadline thread started by TransportBase
            raise

    def _open(self, peer: str, timeout_s: float, cancelled: Callable[[], str | None] | None = None) -> Any:
        host, port = split_address(peer)  # a refused connect returns at once: nothing to cancel
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            _tune(sock)
            if self._client_ctx is not None:
                sock = self._client_ctx.wrap_socket(sock, server_hostname=host)
        except BaseException:
            close_socket(sock)
            raise
        return sock

    def _stop_listening(self) -> None:
        self._accept_thread.join(2.0)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    break
                log.exception("accept failed on %s", self.address)
                time.sleep(0.1)
                continue
            self._start_serving(sock, str(addr[0]))
        self._listener.close()

    def _start_serving(self, sock: socket.socket, source: str) -> None:
        """Admit a just-accepted connection (or close it at once) and serve it in a thread."""
        holder = [sock]  # the current stream: the raw socket, then its TLS wrapper
        ticket = self._admit(source, lambda: close_socket(holder[0]))
        if ticket is None:
            close_socket(sock)
            return
        if not self._incoming_slots.acquire(blocking=False):
            self._guard.release(ticket)
            close_socket(sock)
            return
        threading.Thread(target=self._accepted, args=(holder, ticket), name=f"recv@{self.address}", daemon=True).start()

    def _accepted(self, holder: list, ticket: Ticket) -> None:
        try:
            sock = holder[0]
            _tune(sock)
            if self._server_ctx is not None:
                sock = self._tls_accept(sock, ticket)
                if sock is None:
                    return
                holder[0] = sock
                if ticket.state == "expired":  # the deadline passed while the wrapper was being made
                    close_socket(sock)
                    return
            self._serve_connection(sock, ticket)
        finally:
            self._guard.release(ticket)  # no-op unless the stream ended before its handshake
            self._incoming_slots.release()

    def _tls_accept(self, sock: socket.socket, ticket: Ticket) -> ssl.SSLSocket | None:
        """The TLS server side of an accepted socket; None (socket closed) if the handshake fails."""
        sock.settimeout(self.handshake_timeout_s)
        try:
            return self._server_ctx.wrap_socket(sock, server_side=True)
        except (OSError, ssl.SSLError) as e:
            log.warning("%s: TLS handshake with an incoming connection from %s failed: %s",
                        self.address, ticket.source, e)
            close_socket(sock)
            return None


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
