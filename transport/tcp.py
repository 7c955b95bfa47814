"""`TcpTransport`: links over plain TCP sockets, optionally inside mutual TLS.

It listens at once (a background accept thread); each accepted connection gets a thread that
does TLS (if configured), the shared-secret handshake, then reads messages. Outgoing connections
are dialed lazily and kept (see `TransportBase`).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import threading
import time
from typing import Any

from .conn import close_socket
from .core import DEFAULT_CHUNK_BYTES, TransportBase
from .shaping import TokenBucket
from .tls import TlsConfig

log = logging.getLogger(__name__)

_MAX_INCOMING = 1024


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (IPv6 hosts may be bracketed)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}, want host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP literals."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plaintext(link: str, host: str, tls: TlsConfig | None, allow_plaintext: bool) -> None:
    """Refuse an unencrypted link on a non-loopback host unless plain text was asked for."""
    if tls is None and not allow_plaintext and not is_loopback(host):
        raise ValueError(
            f"refusing plain-text {link} on non-loopback host {host!r}: pass tls=TlsConfig(...) "
            "or allow_plaintext=True"
        )


class TcpTransport(TransportBase):
    """Collectives over TCP (see `TransportBase.all_reduce`).

    host/port: where to listen (port 0 = ephemeral); `address` is the real "host:port".
    secret: shared secret for the mutual HMAC handshake (every peer holds the same one).
    timeout_s: default deadline in seconds for connecting and for each wait without progress.
    chunk_bytes: pipelining unit, in bytes of fp32 input per chunk (same on every peer).
    connections_per_peer: TCP connections opened to each peer; chunks are spread across them.
    max_message_bytes: largest payload accepted from a peer (checked before allocating).
    shaper: optional token bucket limiting this transport's total send rate (tests, benchmarks).
    tls: mutual TLS settings. Without it, plain text is used only on a loopback host or when
    allow_plaintext=True is passed explicitly.
    advertise: address announced to peers instead of "host:port" (e.g. when host is 0.0.0.0).
    pin_memory: receive frames into page-locked buffers, for collectives on GPU tensors
    (default: when CUDA is available).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes,
        timeout_s: float = 60.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        connections_per_peer: int = 1,
        max_message_bytes: int = 256 << 20,
        shaper: TokenBucket | None = None,
        tls: TlsConfig | None = None,
        allow_plaintext: bool = False,
        advertise: str | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__(
            secret=secret,
            timeout_s=timeout_s,
            chunk_bytes=chunk_bytes,
            connections_per_peer=connections_per_peer,
            max_message_bytes=max_message_bytes,
            shaper=shaper,
            pin_memory=pin_memory,
        )
        check_plaintext("TCP", host, tls, allow_plaintext)
        self._server_ctx: ssl.SSLContext | None = tls.server_context() if tls else None
        self._client_ctx: ssl.SSLContext | None = tls.client_context() if tls else None
        self._incoming_slots = threading.BoundedSemaphore(_MAX_INCOMING)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.settimeout(0.2)
        bound_port = self._listener.getsockname()[1]
        self.address = advertise or (f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}")
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"accept@{self.address}", daemon=True)
        self._accept_thread.start()

    def _open(self, peer: str, timeout_s: float) -> Any:
        host, port = split_address(peer)
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
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    break
                log.exception("accept failed on %s", self.address)
                time.sleep(0.1)
                continue
            if not self._incoming_slots.acquire(blocking=False):
                close_socket(sock)
                continue
            threading.Thread(target=self._accepted, args=(sock,), name=f"recv@{self.address}", daemon=True).start()
        self._listener.close()

    def _accepted(self, sock: socket.socket) -> None:
        try:
            _tune(sock)
            if self._server_ctx is not None:
                sock.settimeout(min(self.timeout_s, 30.0))
                try:
                    sock = self._server_ctx.wrap_socket(sock, server_side=True)
                except (OSError, ssl.SSLError) as e:
                    log.warning("%s: TLS handshake with an incoming connection failed: %s", self.address, e)
                    close_socket(sock)
                    return
            self._serve_connection(sock)
        finally:
            self._incoming_slots.release()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
