"""`FaultProxy`: a TCP relay that stalls, cuts and corrupts streams on request. Test/benchmark tool.

    with FaultProxy(b.address) as proxy:
        a = TcpTransport(secret=..., dial_overrides={b.address: proxy.address})
        proxy.corrupt(at_offset=5000, direction="up")   # a's next stream bytes toward b
        ...

The proxy listens on an ephemeral port and forwards every accepted connection to `target`, both
ways. Faults may be set and cleared at any time while traffic flows (from any thread):

* `stall(seconds)`: forward nothing in that direction for `seconds`, then resume;
* `drop_after(nbytes)`: forward `nbytes` more bytes, then reset both sides of the connection
  that carried them (SO_LINGER 0: the ends see a reset, not an orderly close);
* `corrupt(...)`: flip one bit in chosen bytes (at an offset, every n-th byte, or each byte with
  a probability);
* `clear()`: lift every fault.

Directions: "up" is what the connecting side (the dialer) sends toward `target`, "down" is what
comes back, "both" is either. Byte positions for `corrupt` and the byte budget of `drop_after`
count bytes the proxy reads in that direction after the call, over all connections together.

One thread runs every socket (a selector loop), so nothing blocks on a slow end and `close()`
leaves no thread or descriptor behind; what the faults do to the bytes it reads is
``transport.stream_faults``. Pure standard library. Not for production traffic: it
is a loopback test and benchmark aid shipped with the package.
"""

from __future__ import annotations

import errno
import selectors
import socket
import struct
import threading
import time

from .stream_faults import DIRECTIONS, Direction, StreamFaults, directions

_READ_BYTES = 256 << 10
_HIGH_WATER = 1 << 20  # bytes buffered toward one end before the proxy stops reading the other


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}, want host:port")
    return host.strip("[]"), int(port)


def _reset(sock: socket.socket) -> None:
    """Close sock so that the other end sees a reset (RST), not an orderly close."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Pipe:
    """One direction of one relayed connection: bytes read from src, waiting to be written to dst."""

    __slots__ = ("direction", "src", "dst", "buf", "eof", "shut", "reset_when_flushed")

    def __init__(self, direction: str, src: socket.socket, dst: socket.socket) -> None:
        self.direction, self.src, self.dst = direction, src, dst
        self.buf = bytearray()
        self.eof = False  # src ended cleanly
        self.shut = False  # dst was shut down for writing after eof
        self.reset_when_flushed = False  # a drop_after budget ended inside this pipe


class _Conn:
    __slots__ = ("client", "upstream", "connecting", "up", "down", "masks")

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.connecting = True
        self.up = _Pipe("up", client, upstream)
        self.down = _Pipe("down", upstream, client)
        self.masks = {client: 0, upstream: 0}


class FaultProxy:
    """Relays TCP connections from `address` to `target` ("host:port"), injecting faults on request.

    listen_host: where to listen, on an ephemeral port; `address` is the "host:port" to dial
    instead of the target. Thread-safe; a context manager; `close()` may be called any number of
    times. See the module docstring for directions and byte counts.
    """

    def __init__(self, target: str, *, listen_host: str = "127.0.0.1") -> None:
        self._target = _split(target)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self._faults = StreamFaults()
        self._forwarded = {d: 0 for d in DIRECTIONS}
        self._accepted = 0
        self._resets = 0
        self._conns: set[_Conn] = set()
        made: list = []
        try:
            family = socket.AF_INET6 if ":" in listen_host else socket.AF_INET
            self._listener = socket.create_server((listen_host, 0), family=family, backlog=128)
            made.append(self._listener)
            self._listener.setblocking(False)
            port = self._listener.getsockname()[1]
            self.address = f"[{listen_host}]:{port}" if ":" in listen_host else f"{listen_host}:{port}"
            self._wake_r, self._wake_w = socket.socketpair()
            made += [self._wake_r, self._wake_w]
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel = selectors.DefaultSelector()
            made.append(self._sel)
            self._sel.register(self._listener, selectors.EVENT_READ, "listener")
            self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            self._thread = threading.Thread(target=self._loop, name=f"faultproxy@{self.address}", daemon=True)
            self._thread.start()
        except BaseException:
            for m in made:
                m.close()
            raise

    # -- faults ------------------------------------------------------------------------------------
    def stall(self, seconds: float, direction: Direction = "both") -> None:
        """Forward nothing in direction for `seconds` (from now), then resume; bytes wait, none are lost."""
        self._faults.stall(seconds, direction)
        self._wake()

    def drop_after(self, nbytes: int, direction: Direction = "both") -> None:
        """Forward `nbytes` more bytes (counted in direction(s), all connections), then reset both
        ends of the connection that carried the last of them; bytes read beyond them are thrown
        away. Fires once. With nbytes=0 the next connection to carry a byte is reset instead."""
        self._faults.drop_after(nbytes, direction)
        self._wake()

    def corrupt(
        self,
        *,
        at_offset: int | None = None,
        every_nth: int | None = None,
        probability: float | None = None,
        direction: Direction = "up",
        seed: int = 0,
        xor_mask: int | None = None,
    ) -> None:
        """Flip bits in the bytes the proxy reads from now on, in direction(s). Give exactly one of:

        at_offset: the byte `at_offset` bytes after this call's position (0 = the next byte), once;
        every_nth: every n-th byte (the n-th, 2n-th, ... from now);
        probability: each byte independently with this probability (0 < p <= 1).
        Each chosen byte is XORed with xor_mask, or by default one random bit of it is flipped
        (random.Random seeded from `seed` and the direction, so runs repeat). Positions count
        the bytes read in each direction separately, over all connections. Replaces an earlier
        corruption of the same direction.
        """
        self._faults.corrupt(at_offset=at_offset, every_nth=every_nth, probability=probability, direction=direction,
                             seed=seed, xor_mask=xor_mask)

    def clear(self) -> None:
        """Lift every fault (stalls end now; pending drops and corruptions are forgotten)."""
        self._faults.clear()
        self._wake()

    # -- counters ----------------------------------------------------------------------------------
    def bytes_forwarded(self, direction: Direction = "both") -> int:
        """Bytes written so far toward the far end, in direction(s) (bytes a fault threw away or
        that are held by a stall are not counted)."""
        with self._lock:
            return sum(self._forwarded[d] for d in directions(direction))

    @property
    def bytes_corrupted(self) -> int:
        """Bytes that had a bit flipped so far (both directions)."""
        return self._faults.corrupted

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        with self._lock:
            return self._accepted

    @property
    def open_connections(self) -> int:
        """Connections being relayed now."""
        with self._lock:
            return len(self._conns)

    @property
    def resets(self) -> int:
        """Connections ended by a reset: a drop_after, or a reset/error on one end passed on to the other."""
        with self._lock:
            return self._resets

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no connection is being relayed; False if some still is after timeout_s seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._conns, timeout_s)

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop listening and close every relayed connection (both ends reset). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FaultProxy({self.address} -> {self._target[0]}:{self._target[1]})"

    # -- the loop (its own thread; the only one touching sockets) ------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already pending, or closing

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        break
                now = time.monotonic()
                end = self._faults.next_stall_end(now)
                timeout = end - now if end is not None else None
                for conn in list(self._conns):
                    self._update_interest(conn)
                for key, mask in self._sel.select(timeout):
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except BlockingIOError:
                            pass
                    else:
                        conn = key.data
                        if conn in self._conns:
                            self._on_ready(conn, key.fileobj, mask)
        finally:
            for conn in list(self._conns):
                self._end(conn, reset=True)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. out of descriptors: the client's connect fails, we go on
            client.setblocking(False)
            try:
                infos = socket.getaddrinfo(*self._target, type=socket.SOCK_STREAM)
                family, stype, proto, _, addr = infos[0]
                upstream = socket.socket(family, stype, proto)
            except OSError:
                _reset(client)
                continue
            upstream.setblocking(False)
            for s in (client, upstream):
                try:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            conn = _Conn(client, upstream)
            with self._lock:
                self._accepted += 1
                self._conns.add(conn)
            err = upstream.connect_ex(addr)
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                self._end(conn, reset=True)
                continue
            self._update_interest(conn)

    def _update_interest(self, conn: _Conn) -> None:
        want = {conn.client: 0, conn.upstream: 0}
        if conn.connecting:
            want[conn.upstream] = selectors.EVENT_WRITE
        for pipe in (conn.up, conn.down):
            if pipe.eof and not pipe.buf and not pipe.shut:
                if conn.connecting:
                    continue
                try:
                    pipe.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                pipe.shut = True
            stalled = self._faults.stalled(pipe.direction)
            if not pipe.eof and not pipe.reset_when_flushed and len(pipe.buf) < _HIGH_WATER and not stalled:
                want[pipe.src] |= selectors.EVENT_READ
            if pipe.buf and not stalled and not conn.connecting:
                want[pipe.dst] |= selectors.EVENT_WRITE
        if conn.up.shut and conn.down.shut:
            self._end(conn, reset=False)
            return
        for s, events in want.items():
            old = conn.masks[s]
            if events == old:
                continue
            if old == 0:
                self._sel.register(s, events, conn)
            elif events == 0:
                self._sel.unregister(s)
            else:
                self._sel.modify(s, events, conn)
            conn.masks[s] = events

    def _on_ready(self, conn: _Conn, sock: socket.socket, mask: int) -> None:
        if conn.connecting:
            if sock is conn.upstream and mask & selectors.EVENT_WRITE:
                if conn.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                    self._end(conn, reset=True)  # target refused: the client sees a reset
                    return
                conn.connecting = False
            if sock is conn.upstream:
                return
        try:
            if mask & selectors.EVENT_READ:
                pipe = conn.up if sock is conn.client else conn.down
                self._read_into(pipe)
                if pipe.buf and not conn.connecting and not self._faults.stalled(pipe.direction):
                    self._write_from(conn, pipe)  # most often the far end takes it at once
            if mask & selectors.EVENT_WRITE and conn in self._conns:
                self._write_from(conn, conn.down if sock is conn.client else conn.up)
        except OSError:
            self._end(conn, reset=True)  # a reset or error on one end is passed on to the other

    def _read_into(self, pipe: _Pipe) -> None:
        try:
            data = pipe.src.recv(_READ_BYTES)
        except BlockingIOError:
            return
        if not data:
            pipe.eof = True
            return
        data, reset = self._faults.apply(pipe.direction, data)
        if reset:
            pipe.reset_when_flushed = True
        pipe.buf += data

    def _write_from(self, conn: _Conn, pipe: _Pipe) -> None:
        if pipe.buf:
            # Sent under the lock, so that whoever has seen the bytes arrive finds them counted.
            with self._lock:
                try:
                    n = pipe.dst.send(pipe.buf)
                except BlockingIOError:
                    return
                self._forwarded[pipe.direction] += n
            del pipe.buf[:n]
        if pipe.reset_when_flushed and not pipe.buf:
            self._end(conn, reset=True)

    def _end(self, conn: _Conn, reset: bool) -> None:
        if reset:  # counted first: whoever sees the reset must find it counted
            with self._lock:
                self._resets += 1
        for s in (conn.client, conn.upstream):
            if conn.masks[s]:
                self._sel.unregister(s)
                conn.masks[s] = 0
            if reset:
                _reset(s)
            else:
                s.close()
        with self._changed:
            self._conns.discard(conn)
            self._changed.notify_all()
