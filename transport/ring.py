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
number of collectives (different tags, different rings) can run at once on one transport. The
thread, the neighbours, deadlines and aborts are every ring collective's (``transport.ring_collective``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .frames import raw_fp32
from .partition import chunk_bounds, segment_bounds
from .ring_collective import RingCollective, _Abort
from .streams import SideStream
from .wire import MsgType


class RingAllReduce(RingCollective):
    """State machine of one ring all-reduce on one member; `run` is its thread's body."""

    kind = "all_reduce"  # the collective's name in errors and logs

    def __init__(self, core: Any, x: torch.Tensor, ring: list[str], index: int, tag: str, codec: Any,
                 timeout_s: float, chunk_elems: int, out: torch.Tensor | None = None, stream: SideStream | None = None,
                 groups: list[int] | None = None, finite: bool = False, on_final: Any = None) -> None:
        super().__init__(core, x, ring, index, tag, codec, timeout_s, chunk_elems, out=out, stream=stream,
                         groups=groups, finite=finite)
        self.on_final = on_final  # on_final(lo, hi): out[lo:hi] is final (TransportBase.all_reduce)
        # the divisor as a tensor on x's device, made in _run: CUDA divides by a CPU scalar through
        # its reciprocal (one ulp off a third of the time), by a device tensor exactly as the CPU does
        self._g: torch.Tensor
        self._scratch: torch.Tensor | None = None  # see _scratch_for
        self._chunks = [chunk_bounds(a, b, chunk_elems) for a, b in segment_bounds(x.numel(), len(ring))]

    def max_frame_bytes(self, seg: int, chunk: int, aux: int) -> int | None:
        """Largest payload, in bytes, that chunk (seg, chunk) of this collective can take from a
        peer claiming a vector of aux elements; None if that is no chunk of this collective."""
        if aux != self.x.numel() or seg >= len(self._chunks) or chunk >= len(self._chunks[seg]):
            return None
        a, b = self._chunks[seg][chunk]
        return self._frame_bytes(b - a)

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
        return self._stalled(f"{len(rs_todo) + len(ag_todo)} chunk messages")
