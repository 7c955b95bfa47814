"""Ring all-reduce (reduce-scatter + all-gather), pipelined chunk by chunk.

The vector of n elements is cut into G contiguous segments, segment k owned by ring member k, and
each segment into chunks of at most `chunk_elems` elements. Member r starts by sending segment
r-1; every chunk then travels once around the ring:

* reduce-scatter: a member receives a partial sum (a codec frame) from its left neighbour, decodes
  it, adds its own slice in fp32 and, unless it owns the segment, re-encodes and sends it right;
* the owner divides the full sum by G, encodes the mean ONCE with `encode_with_decoded`, keeps the
  decoded value for itself and sends the frame right;
* all-gather: every other member decodes that same frame and forwards it verbatim, so the result
  is bit-identical on every member.

Each collective runs in its own thread, fed by an event queue that the link readers fill; any
number of collectives (different tags, different rings) can run at once on one transport.
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
from .frames import RawFp32, decodes_into, frame_bound, raw_fp32
from .partition import chunk_bounds, segment_bounds
from .streams import SideStream
from .wire import MsgType, encode_tag, pack_header

if TYPE_CHECKING:
    from .conn import Link

log = logging.getLogger(__name__)


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
        self._op: RingAllReduce | None = None

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


class RingAllReduce:
    """State machine of one ring all-reduce on one member; `run` is its thread's body."""

    kind = "all_reduce"  # the collective's name in errors and logs

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
        on_final: Any = None,
    ) -> None:
        self.core = core
        self.on_final = on_final  # on_final(lo, hi): out[lo:hi] is final (TransportBase.all_reduce)
        self.out = out
        self.device = x.device
        self.stream = stream  # CUDA: the side stream this collective runs on (transport.streams)
        self.x = x
        # the divisor as a tensor on x's device, made in _run: CUDA divides by a CPU scalar through
        # its reciprocal (one ulp off a third of the time), by a device tensor exactly as the CPU does
        self._g: torch.Tensor
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
        self._raw: RawFp32 | None = None
        self._into = decodes_into(codec)
        self._scratch: torch.Tensor | None = None  # see _scratch_for
        self._unsent = 0  # in-place sends (see _send_in_place) the socket has not taken yet
        # Ids of connections from the left peer whose loss means our data is lost: those open when
        # the collective started and those that delivered to it (set by the transport, then here).
        self.watch: set[int] = set()
        self._chunks = [chunk_bounds(a, b, chunk_elems) for a, b in segment_bounds(x.numel(), g)]
        self._frame_bytes = frame_bound(codec, core.max_chunk_frame_bytes)

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

    def max_frame_bytes(self, seg: int, chunk: int, aux: int) -> int | None:
        """Largest payload, in bytes, that chunk (seg, chunk) of this collective can take from a
        peer claiming a vector of aux elements; None if that is no chunk of this collective."""
        if aux != self.x.numel() or seg >= len(self._chunks) or chunk >= len(self._chunks[seg]):
            return None
        a, b = self._chunks[seg][chunk]
        return self._frame_bytes(b - a)

    # -- called from other threads -------------------------------------------------------------
    def deliver(self, event: tuple) -> None:
        """Queue an event: ("msg", peer, conn_id, Message, group) | ("lost", peer, conn_id, clean, reason, group,
        groups of the peer's connections still open when it was lost) | ("abort", reason)."""
        self.events.put(event)

    def abort(self, reason: str) -> None:
        self._abort_reason = reason
        self.events.put(("abort", reason))

    # -- the collective --------------------------------------------------------------------------
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

    def _scratch_for(self, count: int) -> torch.Tensor | None:
        """A reused fp32 buffer of count values for a decoded partial sum (compress's codecs
        decode into it; the frame encoded from it is new bytes, so it is free again at once);
        None for any other codec, which decodes into a new tensor."""
        if not self._into:
            return None
        if self._scratch is None or self._scratch.numel() < count:
            self._scratch = torch.empty(self.chunk_elems, dtype=torch.float32, device=self.device)
        return self._scratch[:count]

    def _encode_mean(self, mean: torch.Tensor, out: torch.Tensor) -> Any:
        """The owner's frame of mean; what every member will decode from it goes into out."""
        if self._into:
            return self.codec.encode_with_decoded(mean, out=out)[0]
        frame, mine = self.codec.encode_with_decoded(mean)
        out.copy_(mine.reshape(-1))
        return frame

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

    def _run(self) -> torch.Tensor:
        x, g, r, n = self.x, len(self.ring), self.index, self.x.numel()
        chunks = self._chunks
        first = (r - 1) % g  # the segment this member starts the reduce-scatter with
        out = self.out if self.out is not None else torch.empty(n, dtype=torch.float32, device=self.device)
        # filled here, on the side stream the sums run on (a CUDA collective's): made in __init__,
        # on the caller's stream after the side stream's start event, nothing ordered the fill
        # before the division that reads it
        self._g = torch.full((), float(g), dtype=torch.float32, device=self.device)
        rs_todo = {(k, c) for k in range(g) if k != first for c in range(len(chunks[k]))}
        ag_todo = {(k, c) for k in range(g) if k != r for c in range(len(chunks[k]))}
        self._connect_right()
        # On a GPU every chunk goes through the codec there: only encoded frames reach the host.
        self._raw = raw_fp32(self.codec) if self.device.type == "cpu" else None
        for c, (a, b) in enumerate(chunks[first]):
            self._send_new(MsgType.RS, first, c, x[a:b])
        last_progress = time.monotonic()
        while rs_todo or ag_todo or self._unsent:
            msg, last_progress = self._next_message(last_progress, lambda: self._stall_reason(rs_todo, ag_todo))
            if msg is None:
                continue
            peer = self.left
            key = (msg.seg, msg.chunk)
            if msg.type == MsgType.RS:
                if key not in rs_todo:
                    raise _Abort(f"protocol error: unexpected reduce-scatter chunk {key} from {peer}")
                rs_todo.discard(key)
                self._on_reduce(msg, chunks[msg.seg][msg.chunk], msg.seg == r, out)
            else:
                if key not in ag_todo:
                    raise _Abort(f"protocol error: unexpected all-gather chunk {key} from {peer}")
                ag_todo.discard(key)
                self._on_gather(msg, chunks[msg.seg][msg.chunk], (r + 1) % g != msg.seg, out)
            last_progress = time.monotonic()
        return out

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

    def _on_reduce(self, msg: Any, bounds: tuple[int, int], owner: bool, out: torch.Tensor) -> None:
        """Add our slice to a received partial sum; pass it on (RS), or, as the owner, the mean (AG)."""
        a, b = bounds
        what = f"reduce-scatter chunk {(msg.seg, msg.chunk)}"
        v = self._raw_values(msg.payload, b - a, what)
        if v is None:  # any codec: decode (into this collective's scratch), add, encode into a new frame
            s = self._decode(msg.payload, b - a, what, out=self._scratch_for(b - a)).add_(self.x[a:b])
            self.core._pool.put(msg.payload)
            if owner:
                self._send(MsgType.AG, msg.seg, msg.chunk, self._encode_mean(s.div_(self._g), out[a:b]))
                self._final(a, b)
            else:
                self._send(MsgType.RS, msg.seg, msg.chunk, self.codec.encode(s))
            return
        # Raw fp32: the same arithmetic, done in place in the received frame, which is then
        # re-sealed and sent on as is -- no decode, no new frame. The owner's mean goes straight
        # into out, and the all-gather frame is sent from there.
        torch.add(v, self.x[a:b], out=v)
        if owner:
            torch.div(v, self._g, out=out[a:b])
            self.core._pool.put(msg.payload)
            self._send_in_place(MsgType.AG, msg.seg, msg.chunk, out[a:b])
            self._final(a, b)
            return
        self._raw.seal(msg.payload)
        self._send(MsgType.RS, msg.seg, msg.chunk, msg.payload, recycle=True)

    def _on_gather(self, msg: Any, bounds: tuple[int, int], forward: bool, out: torch.Tensor) -> None:
        """Take the owner's final chunk; forward the frame verbatim unless the next member is the owner."""
        a, b = bounds
        what = f"all-gather chunk {(msg.seg, msg.chunk)}"
        v = self._raw_values(msg.payload, b - a, what)
        if v is None:
            self._decode(msg.payload, b - a, what, out=out[a:b])
        else:
            out[a:b] = v
        if forward:
            self._send(MsgType.AG, msg.seg, msg.chunk, msg.payload, recycle=True)
        else:
            self.core._pool.put(msg.payload)
        self._final(a, b)

    def _final(self, a: int, b: int) -> None:
        """out[a:b] holds its final mean: tell the caller (``on_final``), after the frame that
        carries it on was queued."""
        if self.on_final is not None:
            self.on_final(a, b)

    def _stall_reason(self, rs_todo: set, ag_todo: set) -> str:
        if not rs_todo and not ag_todo:
            return (f"timed out after {self.timeout_s:g} s: right peer {self.right} has not taken "
                    f"{self._unsent} chunk messages")
        connected = self.core._incoming_count(self.left, "any" if self.left_group is None else self.left_group) > 0
        ignored = f"; ignored {self.ignored} messages from non-neighbours such as {self._ignored_from}" \
            if self.ignored else ""
        return (
            f"timed out after {self.timeout_s:g} s without progress from left peer {self.left} "
            f"({'connected' if connected else 'not connected'}); "
            f"{len(rs_todo) + len(ag_todo)} chunk messages still missing{ignored}"
        )
