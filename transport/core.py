"""`TransportBase`: the collectives every link type shares, on top of `transport.links`.

It starts ring collectives (`all_reduce`, `all_gather_mean`), registers each under its tag,
routes every received data message and abort to the collective of its tag -- or buffers it,
bounded, until that collective starts here -- and tells running collectives of lost streams.
Dialing, accepting, the handshake and reading messages are `LinkEndpoint`'s.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Mapping

import torch

from .errors import TransportError, WireError
from .identity import Credentials
from .guard import DEFAULT_HANDSHAKE_TIMEOUT_S, DEFAULT_MAX_UNAUTHENTICATED, DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE
from .frames import default_codec
from .gather import RingAllGather, check_scales
from .gather_reduce import reduce_gathered
from .link_spec import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT_S
from .links import LinkEndpoint, log
from .outputs import check_out, overlaps
from .pending import DEFAULT_MAX_PENDING_BYTES, DEFAULT_PENDING_TTL_TIMEOUTS, PendingFrames
from .ring import RingAllReduce
from .ring_collective import Handle, RingCollective
from .shaping import TokenBucket
from .streams import side_stream_for
from .wire import MsgType

_FINISHED_TAGS_KEPT = 10_000
_MAX_ABORT_BYTES = 4096  # an ABORT carries a reason of at most 4000 UTF-8 bytes


class TransportBase(LinkEndpoint):
    """Collectives over authenticated links; see `TcpTransport` for the parameters (every link type
    takes these keywords, ``transport.link_spec.LinkSpec`` holds them; the link's own: host, port,
    tls, allow_plaintext, advertise)."""

    reports_final = True  # all_reduce takes on_final

    def __init__(
        self,
        *,
        secret: "bytes | Credentials",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        connections_per_peer: int = 1,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        shaper: TokenBucket | None = None,
        pin_memory: bool | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
        max_unauthenticated_per_source: int = DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        pending_ttl_s: float | None = None,
        dial_overrides: Mapping[str, str] | None = None,
    ) -> None:
        # the checks in the order they had before the links moved out (LinkEndpoint repeats its own)
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
        self.chunk_elems = chunk_bytes // 4
        # Largest frame of one chunk under any codec (8 bytes per value: fp32 values and indices).
        self.max_chunk_frame_bytes = 2 * chunk_bytes + 4096
        self._ignored_messages = 0
        self._ops: dict[str, RingCollective] = {}
        # before the links: the admission guard's thread may call _on_tick at once
        self._pending = PendingFrames(int(max_pending_bytes), float(pending_ttl_s), log, lambda: self.address)
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        super().__init__(secret=secret, timeout_s=timeout_s, connections_per_peer=connections_per_peer,
                         max_message_bytes=max_message_bytes, shaper=shaper, pin_memory=pin_memory,
                         handshake_timeout_s=handshake_timeout_s, max_unauthenticated=max_unauthenticated,
                         max_unauthenticated_per_source=max_unauthenticated_per_source, dial_overrides=dial_overrides)

    # -- counters --------------------------------------------------------------------------------
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
        on_final: Callable[[int, int], None] | None = None,
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
        on_final: called as ``on_final(lo, hi)`` from the collective's thread once ``out[lo:hi]``
        holds its final mean (each element once, before `Handle.wait()` returns), so the caller
        can use it while the rest is on the wire; it must be quick and must not raise. Not called
        for a ring of one member or an empty vector.
        """
        groups, codec, timeout = self._check_collective(x, ring, index, codec, timeout_s, out, groups)
        xs = x.detach().contiguous()  # stays on its device: a GPU tensor is encoded on the GPU
        if len(ring) == 1 or x.numel() == 0:
            h = Handle(tag)
            mean = torch.empty(0, device=x.device) if x.numel() == 0 else codec.encode_with_decoded(xs)[1].reshape(-1)
            h._finish(out.copy_(mean) if out is not None else mean, None)
            return h
        op = RingAllReduce(self, xs, list(ring), index, tag, codec, timeout, self.chunk_elems, out=out,
                           stream=side_stream_for(xs), groups=groups if self.group is not None else None, finite=finite,
                           on_final=on_final)
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
        sum(scales[i] * decoded_i) / G (or the average the codec asks for: `transport.gather_reduce`).
        The other arguments are those of `all_reduce`.
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
            h._finish(reduce_gathered([h.sent], scales, result, codec), None)
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

    def _start(self, op: RingCollective) -> Handle:
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
        self._close_links(flush_timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by collectives -----------------------------------------------------------------------
    def _unregister(self, tag: str, op: RingCollective) -> None:
        with self._lock:
            if self._ops.get(tag) is op:
                del self._ops[tag]
            self._finished[tag] = None
            while len(self._finished) > _FINISHED_TAGS_KEPT:
                self._finished.popitem(last=False)

    # -- what the links hand over ------------------------------------------------------------------
    def _admit_data(self, peer: str, group: int | None, mtype: MsgType, tag: str, seg: int, chunk: int, aux: int,
                    nbytes: int) -> bool:
        """`LinkEndpoint._admit_payload` for aborts and data messages: a data message is received
        only for this collective's left neighbour and within its chunk's largest frame."""
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

    def _on_tick(self) -> None:
        """Drop buffered messages past pending_ttl_s (from the admission guard's thread)."""
        with self._lock:
            self._pending.expire()

    def _loss_listeners(self) -> list[Any]:
        """The running collectives: each judges a lost stream itself (caller holds the lock)."""
        return list(self._ops.values())

    def _deliver(self, peer: str, conn_id: int, msg: Any, group: int | None) -> None:
        ev = ("msg", peer, conn_id, msg, group)
        with self._lock:
            op = self._ops.get(msg.tag)
            if op is None:
                if msg.tag not in self._finished:
                    self._pending.add(peer, msg, ev)
                return
        op.deliver(ev)
