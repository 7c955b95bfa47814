"""Ring all-gather of every member's own encoded vector, reduced to the mean on every member.

For codecs that need error feedback (``sign1``, ``topk``): the ring all-reduce re-encodes partial
sums, so no member could keep the residual of what its own contribution lost. Here each member's
contribution is encoded exactly once, by that member, and never re-encoded:

* member r cuts its vector into chunks of at most ``chunk_elems`` values, encodes each chunk once
  (``encode_with_decoded``: it keeps, in ``sent``, exactly what every other member will decode)
  and sends the frame right;
* every member forwards each frame it receives verbatim, unless the next member is the frame's
  originator, so every frame travels G − 1 hops (all traffic is between ring neighbours, and only
  the left neighbour is listened to, as in the all-reduce);
* once a chunk's G frames are in, every member decodes them and sums them in ring-index order,
  ``(s_0·d_0 + s_1·d_1 + … + s_{G−1}·d_{G−1}) / G`` in fp32 (``s_i``: each member's weight, 1
  when not given, applied only when not 1): the same float operations on the same bits on every
  member, so every member gets a bit-identical mean. A codec may ask for another average
  (``topk``'s ``mean="senders"``: each index over the members that sent it; ``clip_median``):
  ``transport.gather_reduce``, as exactly the same on every member.

Each member sends (G − 1)·|frame(n)| bytes, against 2·(G − 1)/G·|frame(n)| for the all-reduce: a
gather pays off for codecs that shrink the vector a lot (1 bit/value and below). Frames are
bounded before allocation by the codec's exact frame size for the chunk; deadlines, aborts and
lost peers behave as in the all-reduce (``transport.ring_collective``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from .gather_reduce import reduce_gathered
from .partition import chunk_bounds
from .ring_collective import RingCollective, _Abort
from .streams import SideStream
from .wire import MsgType


class _Held:
    """A received frame both forwarded and kept for decoding: back to the pool once both are done."""

    __slots__ = ("payload", "_refs", "_lock", "_pool")

    def __init__(self, payload: Any, pool: Any, refs: int) -> None:
        self.payload, self._pool, self._refs = payload, pool, refs
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self._pool.put(self.payload)


def check_scales(scales: Any, g: int) -> list[float] | None:
    """Validate per-member weights (one finite float >= 0 per ring member), or None."""
    if scales is None:
        return None
    values = [float(s) for s in scales]
    if len(values) != g:
        raise ValueError(f"scales has {len(values)} entries for a ring of {g}")
    if not all(v >= 0.0 and v != float("inf") for v in values):
        raise ValueError(f"scales must be finite and >= 0, got {values}")
    return values


class RingAllGather(RingCollective):
    """State machine of one ring all-gather-mean on one member; `run` is its thread's body."""

    kind = "all_gather_mean"

    def __init__(self, core: Any, x: torch.Tensor, ring: list[str], index: int, tag: str, codec: Any,
                 timeout_s: float, chunk_elems: int, out: torch.Tensor | None = None,
                 sent: torch.Tensor | None = None, stream: SideStream | None = None, groups: list[int] | None = None,
                 finite: bool = False, scales: list[float] | None = None) -> None:
        super().__init__(core, x, ring, index, tag, codec, timeout_s, chunk_elems, out=out, stream=stream,
                         groups=groups, finite=finite)
        self.sent = sent
        self.scales = scales
        self._gchunks = chunk_bounds(0, x.numel(), chunk_elems)

    def max_frame_bytes(self, seg: int, chunk: int, aux: int) -> int | None:
        """Largest frame of member ``seg``'s chunk ``chunk``; None if that is no chunk we expect
        (our own frames never come back, and the length must be ours)."""
        if aux != self.x.numel() or seg >= len(self.ring) or seg == self.index or chunk >= len(self._gchunks):
            return None
        a, b = self._gchunks[chunk]
        return self._frame_bytes(b - a)

    def _encode_own(self, values: torch.Tensor, sent: torch.Tensor) -> Any:
        """This member's frame of values; what every member will decode from it goes into sent."""
        if self._into:
            return self.codec.encode_with_decoded(values, out=sent)[0]
        frame, mine = self.codec.encode_with_decoded(values)
        sent.copy_(mine.reshape(-1))
        return frame

    def _run(self) -> torch.Tensor:
        x, g, r, n = self.x, len(self.ring), self.index, self.x.numel()
        chunks = self._gchunks
        out = self.out if self.out is not None else torch.empty(n, dtype=torch.float32, device=self.device)
        sent = self.sent if self.sent is not None else torch.empty(n, dtype=torch.float32, device=self.device)
        self.handle.sent = sent
        held: list[dict[int, _Held]] = [{} for _ in chunks]
        todo = {(j, c) for j in range(g) if j != r for c in range(len(chunks))}
        self._connect_right()
        for c, (a, b) in enumerate(chunks):
            self._send(MsgType.GATHER, r, c, self._encode_own(x[a:b], sent[a:b]))
        try:
            last_progress = time.monotonic()
            while todo:
                msg, last_progress = self._next_message(last_progress, lambda: self._gather_stall(todo))
                if msg is None:
                    continue
                key = (msg.seg, msg.chunk)
                if msg.type != MsgType.GATHER or key not in todo:
                    raise _Abort(f"protocol error: unexpected {msg.type.name} {key} from {self.left}")
                todo.discard(key)
                forward = (r + 1) % g != msg.seg
                frame = _Held(msg.payload, self.core._pool, 2 if forward else 1)
                held[msg.chunk][msg.seg] = frame
                if forward:
                    self._queue(MsgType.GATHER, msg.seg, msg.chunk, [msg.payload], frame.release)
                if len(held[msg.chunk]) == g - 1:
                    self._reduce_chunk(msg.chunk, held[msg.chunk], sent, out)
                    held[msg.chunk] = {}
                last_progress = time.monotonic()
        finally:
            for frames in held:  # an abort: drop our hold on what never got decoded
                for frame in frames.values():
                    frame.release()
        return out

    def _reduce_chunk(self, c: int, frames: dict[int, _Held], sent: torch.Tensor, out: torch.Tensor) -> None:
        """Decode chunk c of every member and write their mean, in ring-index order, into out."""
        a, b = self._gchunks[c]
        decoded = []
        for j in range(len(self.ring)):
            if j == self.index:
                decoded.append(sent[a:b])
                continue
            frame = frames.pop(j)
            try:
                decoded.append(self._decode(frame.payload, b - a, f"chunk {c} of member {j}"))
            finally:
                frame.release()
        reduce_gathered(decoded, self.scales, out[a:b], self.codec)

    def _gather_stall(self, todo: set) -> str:
        return self._stalled(f"{len(todo)} frames")
