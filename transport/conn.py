"""One outgoing, authenticated connection with its own sender thread, and a link = N of them."""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from typing import Callable, Sequence

from .shaping import TokenBucket

log = logging.getLogger(__name__)

OnError = Callable[[str], None]
OnDone = Callable[[], None]
Buffers = Sequence[bytes | bytearray | memoryview]


def close_socket(sock) -> None:
    """Shut down (waking any blocked reader) and close, ignoring errors."""
    try:
        if isinstance(sock, socket.socket):
            # The plain-socket method, also for an SSLSocket: it shuts the descriptor down without
            # touching the SSL object that another thread may be reading through.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        else:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):  # already closed or never connected: nothing left to shut down
        pass
    try:
        sock.close()
    except (OSError, ValueError):
        pass


class Connection:
    """Sends queued messages on one socket from a background thread, in queue order.

    `send` never blocks on the network. If the socket fails, the failing message's `on_error`
    and those of everything still queued are called with a reason, and the connection is dead:
    later sends fail at once.
    """

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        count_sent: Callable[[int], None],
        shaper: TokenBucket | None = None,
        peer_group: int | None = None,
    ) -> None:
        self.sock = sock
        self.peer_group = peer_group  # the group the peer proved in the handshake (None: none)
        self.peer = peer
        self._count_sent = count_sent
        self._shaper = shaper
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._dead: str | None = None
        self._lock = threading.Lock()
        # Plain sockets write a message's buffers with one sendmsg (scatter-gather, no joining
        # copy), gRPC streams with send_buffers (one copy into its messages); TLS sockets have
        # no sendmsg and write them one by one.
        self._gather = type(sock) is socket.socket and hasattr(sock, "sendmsg")
        self._send_buffers = getattr(sock, "send_buffers", None)
        self._thread = threading.Thread(target=self._run, name=f"send->{peer}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._dead is None

    def send(self, buffers: Buffers, on_error: OnError | None, on_done: OnDone | None = None) -> None:
        """Queue one message (its buffers are sent back to back, and must not change until then).

        on_done() is called from the sender thread once the socket has taken every byte (the
        buffers may then be reused); on_error(reason) instead if the message cannot be sent.
        """
        with self._lock:
            dead = self._dead
            if dead is None:
                self._q.put((buffers, on_error, on_done))
                return
        if on_error is not None:
            on_error(dead)

    def _fail(self, reason: str, first: OnError | None) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            pending = []
            while True:
                try:
                    pending.append(self._q.get_nowait())
                except queue.Empty:
                    break
        for cb in [first] + [item[1] for item in pending if item is not None]:
            if cb is not None:
                try:
                    cb(reason)
                except Exception:  # a callback must not kill the sender thread
                    log.exception("on_error callback failed")

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            buffers, on_error, on_done = item
            try:
                n = sum(len(b) for b in buffers)
                if self._shaper is not None:
                    self._shaper.consume(n)
                self._write(buffers)
                self._count_sent(n)
            except Exception as e:  # OSError, or an SSL/gRPC stream closed under us
                self._fail(f"sending to {self.peer} failed: {e!r}", on_error)
                close_socket(self.sock)
                return
            if on_done is not None:
                try:
                    on_done()
                except Exception:  # a callback must not kill the sender thread
                    log.exception("on_done callback failed")

    def _write(self, buffers: Buffers) -> None:
        if len(buffers) == 1:
            self.sock.sendall(buffers[0])
        elif self._send_buffers is not None:
            self._send_buffers(buffers)
        elif self._gather:
            _sendmsg_all(self.sock, buffers)
        else:
            for b in buffers:
                self.sock.sendall(b)

    def close(self, flush_timeout_s: float) -> None:
        """Send what is queued (for at most flush_timeout_s), then close the socket."""
        with self._lock:
            if self._dead is None:
                self._dead = "connection closed"
                self._q.put(None)
        self._thread.join(flush_timeout_s)
        close_socket(self.sock)
        self._thread.join(1.0)


def _sendmsg_all(sock: socket.socket, buffers: Buffers) -> None:
    """sendall() for a list of buffers: sendmsg until every byte is written (no joining copy)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        k = sock.sendmsg(views)
        while views and k >= len(views[0]):  # drop the buffers written completely ...
            k -= len(views[0])
            views.pop(0)
        if k:  # ... and the written part of the next one
            views[0] = views[0][k:]


class Link:
    """All connections to one peer; messages are spread round-robin across them."""

    def __init__(self, peer: str, conns: list[Connection]) -> None:
        if not conns:
            raise ValueError("a link needs at least one connection")
        self.peer = peer
        self.conns = conns
        self._rr = itertools.cycle(range(len(conns)))
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return all(c.alive for c in self.conns)

    @property
    def peer_group(self) -> int | None:
        """The group the peer proved when these connections were opened (None: no group identity)."""
        return self.conns[0].peer_group

    def send(self, buffers: Buffers, on_error: OnError | None, on_done: OnDone | None = None) -> None:
        with self._lock:
            conn = self.conns[next(self._rr)]
        conn.send(buffers, on_error, on_done)

    def close(self, flush_timeout_s: float) -> None:
        for c in self.conns:
            c.close(flush_timeout_s)
