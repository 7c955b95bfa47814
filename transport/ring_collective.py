"""One ring collective on one member: what the all-reduce (``transport.ring``) and the all-gather
(``transport.gather``) share.

A collective runs in its own thread (``run``), fed by an event queue that the link readers fill
(``deliver``). It sends only to its right neighbour, over one link it opens at its start, and takes
data and aborts only from its left neighbour (checked by address and by the group it proved); any
other sender is ignored and counted. It ends with its result in its ``Handle``, or aborted: after
``timeout_s`` without progress, on a lost connection its data may have travelled on, on a bad frame,
or when told to (``abort``); an abort travels on to the right neighbour, so the whole ring stops
instead of waiting out its deadlines. A subclass defines ``kind``, ``max_frame_bytes`` and ``_run``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from compress.finite import all_finite

from .errors import CollectiveAborted, TransportError
from .frames import RawFp32, decodes_into, frame_bound
from .streams import SideStream
from .wire import MsgType, encode_tag, pack_header

if TYPE_CHECKING:
    from .conn import Link

log = logging.getLogger("transport.ring")  # one logger for the ring collectives' messages, as before the split


class Handle:
    """The pending result of one collective."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._event = threading.Event()
        #: all_gather_mean: what every member decoded of this member's own contribution (valid
        #: once wait() returned); None for other collectives
        self.sent: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._op: RingCollective | None = None

    def _finish(self, result: torch.Tensor | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._event.set()
        # Break the handle <-> collective cycle, so the result is freed as soon as the caller
        # drops it, not at the next cyclic garbage collection.
        self._op = None

    def done(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._event.is_set()

    def abort(self, reason: str) -> None:
        """End the collective now if it still runs: ``wait()`` raises CollectiveAborted(reason)
        and the ring's neighbours hear of it."""
        op = self._op
        if op is not None:
            op.abort(reason)

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        """The mean over the ring (float32, same shape). Raises CollectiveAborted on failure.

        With `timeout_s`, a collective still running after that many seconds is aborted.
        """
        if not self._event.wait(timeout_s):
            self.abort(f"wait() timed out after {timeout_s:g} s")
            self._event.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class _Abort(Exception):
    def __init__(self, reason: str, remote: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.remote = reason, remote


class RingCollective:
    """State machine of one ring collective on one member; ``run`` is its thread's body."""

    kind = "collective"  # the collective's name in errors and logs

    def __init__(
        self,
        core: Any,
        x: torch.Tensor,
        ring: list[str],
        index: int,
        tag: str,
        codec: Any,
        timeout_s: float,
        chunk_elems: int,
        out: torch.Tensor | None = None,
        stream: SideStream | None = None,
        groups: list[int] | None = None,
        finite: bool = False,
    ) -> None:
        self.core = core
        self.out = out
        self.device = x.device
        self.stream = stream  # CUDA: the side stream this collective runs on (transport.streams)
        self.x = x
        self.ring = ring
        self.index = index
        self.tag = tag
        self.tag_raw = encode_tag(tag)
        self.codec = codec
        self.timeout_s = timeout_s
        self.chunk_elems = chunk_elems
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self._abort_reason: str | None = None  # also read while it connects, before it reads events
        self.handle = Handle(tag)
        self.handle._op = self
        g = len(ring)
        self.left = ring[(index - 1) % g]
        self.right = ring[(index + 1) % g]
        # the groups the neighbours must have proved in the handshake (None: not checked)
        self.left_group = None if groups is None else groups[(index - 1) % g]
        self.right_group = None if groups is None else groups[(index + 1) % g]
        self.finite = finite
        self.ignored = 0  # messages (data or aborts) from anyone but the left neighbour, dropped
        self._ignored_from: str | None = None
        self._link: Link | None = None
        self._raw: RawFp32 | None = None  # raw fp32 frames: sent from where the values lie (_send_in_place)
        self._into = decodes_into(codec)
        self._unsent = 0  # in-place sends (see _send_in_place) the socket has not taken yet
        # Ids of connections from the left peer whose loss means our data is lost: those open when
        # the collective started and those that delivered to it (set by the transport, then here).
        self.watch: set[int] = set()
        self._frame_bytes = frame_bound(codec, core.max_chunk_frame_bytes)

    def max_frame_bytes(self, seg: int, chunk: int, aux: int) -> int | None:
        """Largest payload, in bytes, that chunk (seg, chunk) of this collective can take from a
        peer claiming a vector of aux elements; None if that is no chunk of this collective."""
        raise NotImplementedError

    def _run(self) -> torch.Tensor:
        """The collective itself, in its thread: returns the result, raises _Abort."""
        raise NotImplementedError

    def from_left(self, peer: str, group: int | None) -> bool:
        """Whether a connection from address peer that proved group is this collective's left
        neighbour: the only one it takes data and aborts from."""
        return peer == self.left and (self.left_group is None or group == self.left_group)

    def _ignore(self, peer: str, group: int | None, what: str) -> None:
        """Drop a message from someone who is not the left neighbour (logged once per collective)."""
        self.ignored += 1
        if self._ignored_from is None:
            self._ignored_from = f"{peer} (group {group})"
            log.warning("%s %r on %s: ignored %s from %s: only the left neighbour %s (group %s) may "
                        "send data or aborts", self.kind, self.tag, self.core.address, what, self._ignored_from, self.left,
                        self.left_group)
        with self.core._stats_lock:
            self.core._ignored_messages += 1

    # -- called from other threads -------------------------------------------------------------
    def deliver(self, event: tuple) -> None:
        """Queue an event: ("msg", peer, conn_id, Message, group) | ("lost", peer, conn_id, clean, reason, group,
        groups of the peer's connections still open when it was lost) | ("abort", reason)."""
        self.events.put(event)

    def abort(self, reason: str) -> None:
        self._abort_reason = reason
        self.events.put(("abort", reason))

    # -- the collective's machinery -------------------------------------------------------------
    def run(self) -> None:
        out, err = None, None
        try:
            if self.stream is None:
                out = self._run()
            else:
                with self.stream.running():  # complete when wait() returns, even after an abort
                    out = self._run()
                self.stream.hand_over(out, self.handle.sent)
        except _Abort as e:
            err = self._error(e)
            self._propagate(e)
        except Exception as e:  # a bug or a codec error: still an abort, never a hang
            log.exception("%s %r failed", self.kind, self.tag)
            err = CollectiveAborted(f"{self.kind} {self.tag!r} on {self.core.address}: internal error: {e!r}")
            err.__cause__ = e
            self._propagate(_Abort(f"internal error: {e!r}"))
        finally:
            self.core._unregister(self.tag, self)
            self.handle._finish(out, err)

    def _error(self, e: _Abort) -> CollectiveAborted:
        where = f"{self.kind} {self.tag!r} on {self.core.address} (ring index {self.index} of {len(self.ring)})"
        err = CollectiveAborted(f"{where}: {e.reason}")
        if e.__cause__ is not None:
            err.__cause__ = e.__cause__
        return err

    def _propagate(self, e: _Abort) -> None:
        """Tell the right neighbour, so the abort travels around the ring instead of waiting out deadlines."""
        link = self._link or self.core._existing_link(self.right)
        if link is None or not link.alive:
            return
        reason = e.reason if e.remote else f"{self.core.address}: {e.reason}"
        payload = reason.encode("utf-8", "replace")[:4000]
        head = pack_header(MsgType.ABORT, self.tag_raw, 0, 0, 0, len(payload))
        link.send([head + payload], None)

    def _queue(self, mtype: MsgType, seg: int, chunk: int, parts: list, on_done: Any) -> None:
        """Queue one message whose payload is the concatenation of parts (sent without joining)."""
        assert self._link is not None
        head = pack_header(mtype, self.tag_raw, seg, chunk, self.x.numel(), sum(len(p) for p in parts))
        self._link.send([head, *parts], self._on_send_error, on_done)

    def _send(self, mtype: MsgType, seg: int, chunk: int, frame: bytes | bytearray | memoryview,
              recycle: bool = False) -> None:
        """Queue one message; with recycle, frame (a pool buffer) goes back to the pool once sent."""
        pool = self.core._pool
        self._queue(mtype, seg, chunk, [frame], (lambda: pool.put(frame)) if recycle else None)

    def _send_in_place(self, mtype: MsgType, seg: int, chunk: int, values: torch.Tensor) -> None:
        """Send the raw fp32 frame of values (a slice of x or of the result) from where they lie;
        the collective does not end before the socket has taken it, so the caller may then
        change both."""
        assert self._raw is not None
        self._unsent += 1
        self._queue(mtype, seg, chunk, self._raw.parts(values), lambda: self.events.put(("sent",)))

    def _send_new(self, mtype: MsgType, seg: int, chunk: int, values: torch.Tensor) -> None:
        """Encode values into a new frame and send it (raw fp32: straight from values' memory)."""
        if self._raw is None:
            self._send(mtype, seg, chunk, self.codec.encode(values))
        else:
            self._send_in_place(mtype, seg, chunk, values)

    def _on_send_error(self, reason: str) -> None:
        self.abort(reason)

    def _decode(self, payload: bytes | bytearray | memoryview, want: int, what: str,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The frame's values (a new tensor, or out: want fp32 values where the result goes)."""
        try:
            # compress's codecs check the declared count first: nothing is decompressed beyond it
            expect = {"count": want} if self._into else {}
            if out is not None and self._into:
                t = self.codec.decode(payload, out=out)
            elif self.device.type == "cpu":
                t = self.codec.decode(payload, **expect)
            else:
                t = self.codec.decode(payload, device=self.device, **expect)
        except Exception as e:
            raise _Abort(f"bad frame for {what} from {self.left}: {e!r}") from e
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != want:
            raise _Abort(f"frame for {what} from {self.left} decodes to {getattr(t, 'shape', type(t))}, want {want} fp32 "
                "(do all members use the same chunk_bytes?)")
        self._check_finite(t, what)
        if out is not None and t is not out:
            out.copy_(t.reshape(-1))
        return t.reshape(-1)

    def _raw_values(self, payload: bytes | bytearray | memoryview, want: int, what: str) -> torch.Tensor | None:
        """The checked fp32 values of a raw fp32 frame as a writable view into it; None: use _decode."""
        if self._raw is None:
            return None
        try:
            v = self._raw.values(payload, want)
        except Exception as e:
            raise _Abort(f"bad frame for {what} from {self.left}: {e!r}") from e
        if v is not None:
            self._check_finite(v, what)
        return v

    def _check_finite(self, values: torch.Tensor, what: str) -> None:
        """With finite=True, abort on a received frame holding NaN or Inf (nothing applied)."""
        if self.finite and not all_finite(values):
            raise _Abort(f"bad frame for {what} from {self.left}: it holds NaN or Inf values, which this "
                         "collective's inputs never do (finite=True)")

    def _connect_right(self) -> None:
        """Open the link to the right neighbour (checking the group it proved) and, with
        finite=True, refuse a non-finite input of our own: the start of every ring collective."""
        deadline = time.monotonic() + self.timeout_s
        try:
            self._link = self.core._get_link(self.right, deadline, cancelled=lambda: self._abort_reason)
        except TransportError as e:
            raise _Abort(f"cannot reach right peer {self.right}: {e}") from e
        if self.right_group is not None and self._link.peer_group != self.right_group:
            link, self._link = self._link, None  # never send to it, not even our abort
            raise _Abort(f"right peer {self.right} proved group {link.peer_group}, the ring says group "
                         f"{self.right_group}: not sending to it")
        if self.finite and not all_finite(self.x):
            raise _Abort("this member's own input holds NaN or Inf (finite=True)")

    def _next_message(self, last_progress: float, stall: Any) -> tuple[Any, float]:
        """The next data message from the left neighbour (its sender and vector length checked),
        handling on the way everything else the event queue holds. Returns (message, the time
        of the last progress); the message is None when only an in-place send was taken.
        Raises _Abort on an abort, a lost connection we depend on, or timeout_s without
        progress (reason: ``stall()``)."""
        n = self.x.numel()
        while True:
            wait = last_progress + self.timeout_s - time.monotonic()
            if wait <= 0:
                raise _Abort(stall())
            try:
                ev = self.events.get(timeout=wait)
            except queue.Empty:
                continue
            kind = ev[0]
            if kind == "sent":
                self._unsent -= 1
                return None, time.monotonic()
            if kind == "abort":
                raise _Abort(ev[1])
            if kind == "lost":
                peer, conn_id, clean, reason, group, still_open = ev[1:7]
                if not self.from_left(peer, group):
                    continue
                # A broken stream may have carried our data; a clean close matters only for a
                # connection we depend on, once no other connection from that peer was left
                # when it closed (data the others carried before closing is queued ahead of
                # the last one's loss, so it is taken first).
                left_then = sum(1 for g in still_open if self.left_group is None or g == self.left_group)
                if not clean or (conn_id in self.watch and left_then == 0):
                    raise _Abort(f"lost the connection from left peer {peer}: {reason}")
                continue
            peer, conn_id, msg = ev[1], ev[2], ev[3]
            group = ev[4] if len(ev) > 4 else None
            if not self.from_left(peer, group):  # only the left neighbour may send data or abort
                self._ignore(peer, group, msg.type.name)
                self.core._pool.put(msg.payload)
                continue
            if msg.type == MsgType.ABORT:
                text = bytes(msg.payload).decode("utf-8", "replace")
                raise _Abort(f"aborted by peer {text}", remote=True)
            self.watch.add(conn_id)
            if msg.aux != n:
                raise _Abort(f"length mismatch: left peer {peer} reduces {msg.aux} elements, this member {n}")
            return msg, last_progress

    def _stalled(self, missing: str) -> str:
        """Why the collective timed out with messages from the left neighbour still ``missing``."""
        connected = self.core._incoming_count(self.left, "any" if self.left_group is None else self.left_group) > 0
        ignored = f"; ignored {self.ignored} messages from non-neighbours such as {self._ignored_from}" \
            if self.ignored else ""
        return (f"timed out after {self.timeout_s:g} s without progress from left peer {self.left} "
                f"({'connected' if connected else 'not connected'}); {missing} still missing{ignored}")
