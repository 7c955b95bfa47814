"""`GrpcTransport`: the same links and collectives over gRPC bidirectional streams.

Each connection is one bidirectional-streaming call on its own channel (and so its own HTTP/2
TCP connection), carrying the same messages as the TCP link: the shared-secret handshake first,
then envelopes and frames as raw bytes (no protobuf, no pickle). Optional mutual TLS uses gRPC's
SSL credentials (gRPC always checks that the peer's certificate names the dialed host).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import grpc

from .addresses import check_plaintext, split_address
from .core import TransportBase
from .errors import PeerDisconnected
from .tls import TlsConfig

log = logging.getLogger(__name__)

SERVICE = "diloco.transport.Link"
METHOD = f"/{SERVICE}/Stream"
_MAX_STREAMS = 512
_EOF = object()
GRACEFUL_CLOSE_S = 5.0  # how long a closing dialer waits for the peer to finish the call
CANCEL_CHECK_S = 0.25  # how often a dial waiting for its channel checks whether it was cancelled
#: Largest gRPC message, in bytes: writes are split into messages of at most this size, so the
#: receive limit (and what gRPC buffers for a stream that has not authenticated) stays small.
MESSAGE_BYTES = 1 << 20
#: A write's last message may be this much longer than MESSAGE_BYTES instead of leaving a short
#: message of its own: a 1 MiB ring chunk (the default chunk_bytes) plus its envelope and frame
#: header (a few hundred bytes) then travels as one gRPC message, not two (each costs thread hand-offs and
#: gRPC's per-message work on both sides). The receive limit is MESSAGE_BYTES + MESSAGE_SLACK.
MESSAGE_SLACK = 1 << 10
#: Bytes a stream may deliver before its handshake is done (the handshake needs a few hundred);
#: past them its reader waits, so gRPC's flow control holds the sender back.
PREAUTH_BYTES = 4096


class StreamSocket:
    """A socket-like byte stream over one gRPC stream: writes become messages, reads drain them."""

    def __init__(self, outbox: "queue.SimpleQueue[bytes | None]", inbound: Iterator[bytes], on_close: Callable[[], None],
                 message_bytes: int = MESSAGE_BYTES, slack_bytes: int = MESSAGE_SLACK) -> None:
        self._outbox = outbox
        self._message_bytes = message_bytes  # writes are split into gRPC messages of this size ...
        self._slack_bytes = slack_bytes  # ... the last one up to this much longer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._buf = memoryview(b"")
        self._timeout: float | None = None
        self._closed = False
        self._broken: str | None = None  # set when the peer's side of the stream ended
        self._on_close = on_close
        self._lock = threading.Lock()
        self._ended = threading.Event()  # the peer's side of the stream is over
        self._gate = threading.Event()  # set once authenticated, or closed
        self._authed = False
        self._preauth_bytes = 0
        threading.Thread(target=self._pump, args=(inbound,), name="grpc-pump", daemon=True).start()

    def authenticated(self) -> None:
        """The handshake succeeded: deliver messages without the pre-authentication bound."""
        self._authed = True
        self._gate.set()

    def _admit(self, item: bytes) -> bool:
        """Whether to deliver a message; before authentication, past PREAUTH_BYTES, wait for it."""
        if not self._authed:
            self._preauth_bytes += len(item)
            if self._preauth_bytes > PREAUTH_BYTES:
                self._gate.wait()
        return self._authed or self._preauth_bytes <= PREAUTH_BYTES

    def _pump(self, inbound: Iterator[bytes]) -> None:
        try:
            for item in inbound:
                if not self._admit(item):
                    self._broken = f"more than {PREAUTH_BYTES} bytes before authentication"
                    self._inbox.put(_EOF)
                    return
                self._inbox.put(item)
            self._inbox.put(_EOF)
            self._broken = "stream ended by peer"
        except Exception as e:  # grpc.RpcError when the call ends abnormally (cancelled, peer gone)
            self._broken = f"gRPC stream ended: {_describe(e)}"
            self._inbox.put(e)
        finally:
            self._ended.set()

    def wait_ended(self, timeout_s: float) -> bool:
        """Wait until the peer's side of the stream is over; False if ``timeout_s`` passed first."""
        return self._ended.wait(timeout_s)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        self.send_buffers([data])

    def send_buffers(self, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
        """Send buffers back to back as gRPC messages of message_bytes bytes, the last one of at
        most message_bytes + slack_bytes, each copied once out of them (no joined copy of the
        whole message first)."""
        if self._closed or self._broken:
            raise BrokenPipeError(self._broken or "stream closed")
        views = [memoryview(b).cast("B") for b in buffers]
        left = sum(len(v) for v in views)
        step, last = self._message_bytes, self._message_bytes + self._slack_bytes
        want = step if left > last else left  # the size of the message being filled
        pending: list[memoryview] = []
        size = 0
        for view in views:
            while view:
                take = view[:want - size]
                pending.append(take)
                size += len(take)
                view = view[len(take):]
                if size == want:
                    self._outbox.put(b"".join(pending))
                    left -= size
                    pending, size = [], 0
                    want = step if left > last else left

    def _take(self, n: int) -> memoryview:
        """Up to n bytes of the current message (the next one once it is used up); empty at EOF."""
        if not self._buf:
            try:
                item = self._inbox.get(timeout=self._timeout)
            except queue.Empty:
                raise TimeoutError("timed out") from None
            if item is _EOF:
                self._inbox.put(_EOF)
                return memoryview(b"")
            if isinstance(item, Exception):
                self._inbox.put(item)
                raise PeerDisconnected(f"gRPC stream ended: {_describe(item)}")
            self._buf = memoryview(item)
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def recv(self, n: int) -> bytes:
        return bytes(self._take(n))

    def recv_into(self, view: memoryview, n: int) -> int:
        data = self._take(n)  # copied once, from gRPC's message straight into view
        view[: len(data)] = data
        return len(data)

    def shutdown(self, how: int = socket.SHUT_RDWR) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._gate.set()
        self._outbox.put(None)  # ends our side of the stream
        self._inbox.put(_EOF)  # wakes a blocked reader
        self._on_close()

    def close(self) -> None:
        self.shutdown()


def _describe(e: Exception) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return f"{e.code().name}: {e.details()}"
    return repr(e)


def _source(peer: str) -> str:
    """The address without port of a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5")."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return peer  # "unix:..." and the like: the whole string names the source


def _drain(outbox: "queue.SimpleQueue[bytes | None]") -> Iterator[bytes]:
    while (item := outbox.get()) is not None:
        yield item


class GrpcTransport(TransportBase):
    """Collectives over gRPC streams; parameters as for `TcpTransport` (no shaper-free extras).

    Against hostile peers: each call is admitted like a TCP connection (caps on unauthenticated
    calls per listener and per source address, whole-handshake deadline `handshake_timeout_s`,
    also used as gRPC's own TLS/HTTP2 handshake timeout); over a cap a call ends at once with
    RESOURCE_EXHAUSTED. Writes travel as gRPC messages of min(MESSAGE_BYTES, max_message_bytes)
    bytes, a write's last one up to MESSAGE_SLACK longer (that sum is also the receive limit),
    and a call delivers at most PREAUTH_BYTES before it has authenticated (its reader then
    waits, holding the sender back).
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
            check_plaintext("gRPC", host, tls, allow_plaintext)
            self._tls_pem = tls.read_pem() if tls else None
            self._message_bytes = min(MESSAGE_BYTES, self.max_message_bytes)
            limit = self._message_bytes + MESSAGE_SLACK
            self._options = [
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
                ("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)),
                ("grpc.use_local_subchannel_pool", 1),  # a channel per connection really is its own TCP connection
            ]
            self._server = grpc.server(
                ThreadPoolExecutor(max_workers=_MAX_STREAMS, thread_name_prefix="grpc-link"),
                options=self._options,
                maximum_concurrent_rpcs=_MAX_STREAMS,
            )
            handler = grpc.stream_stream_rpc_method_handler(self._handle)  # raw bytes in and out
            self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Stream": handler}),))
            bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            if self._tls_pem is not None:
                cert, key, ca = self._tls_pem
                creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
                bound = self._server.add_secure_port(bind, creds)
            else:
                bound = self._server.add_insecure_port(bind)
            if bound == 0:
                raise OSError(f"gRPC could not bind {bind}")
            self._server.start()
        except BaseException:
            self._guard.close()  # the deadline thread started by TransportBase
            raise
        self.address = advertise or (f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}")
        self._guard.name = self.address

    # -- accepting side ----------------------------------------------------------------------------
    def _handle(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        holder: list[StreamSocket] = []
        ticket = self._admit(_source(context.peer()), lambda: holder[0].shutdown() if holder else None)
        if ticket is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many unauthenticated streams")
        sock = StreamSocket(outbox, request_iterator, on_close=lambda: None, message_bytes=self._message_bytes)
        holder.append(sock)
        context.add_callback(sock.shutdown)  # the call ended (client gone or cancelled)
        if ticket.state == "expired":
            sock.shutdown()
        threading.Thread(target=self._serve_connection, args=(sock, ticket), name=f"recv@{self.address}",
                         daemon=True).start()
        yield from _drain(outbox)

    def _on_authenticated(self, sock: Any) -> None:
        sock.authenticated()

    def _stop_listening(self) -> None:
        self._server.stop(grace=0.5)

    # -- dialing side ------------------------------------------------------------------------------
    def _open(self, peer: str, timeout_s: float, cancelled: Callable[[], str | None] | None = None) -> Any:
        host, port = split_address(peer)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._tls_pem is not None:
            cert, key, ca = self._tls_pem
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            channel = grpc.secure_channel(target, creds, options=self._options)
        else:
            channel = grpc.insecure_channel(target, options=self._options)
        ready, end = grpc.channel_ready_future(channel), time.monotonic() + timeout_s
        while True:  # in slices: the collective that dials may be aborted meanwhile
            try:
                ready.result(timeout=max(0.0, min(CANCEL_CHECK_S, end - time.monotonic())))
                break
            except grpc.FutureTimeoutError:
                why = cancelled() if cancelled is not None else None
                if why is not None or time.monotonic() >= end:
                    ready.cancel()
                    channel.close()
                    raise ConnectionRefusedError(f"gRPC channel to {peer} not ready within {timeout_s:.1f} s"
                                                 if why is None else f"gRPC channel to {peer}: {why}") from None
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        call = channel.stream_stream(METHOD)(_drain(outbox))
        sockets: list[StreamSocket] = []

        def on_close() -> None:
            # Our request stream has ended (shutdown queued the end marker). Cancelling now would
            # drop messages still queued in gRPC, so let the peer drain them and finish the call.
            sockets[0].wait_ended(GRACEFUL_CLOSE_S)
            call.cancel()
            channel.close()

        sockets.append(StreamSocket(outbox, call, on_close, message_bytes=self._message_bytes))
        return sockets[0]
