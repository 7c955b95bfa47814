"""Wire format: a fixed 36-byte envelope, then the tag (UTF-8), then the payload.

    magic "DLTP" | version u8 | type u8 | tag_len u16 | seg u32 | chunk u32 | aux u64 | payload_len u64
    | crc u32

Every field is checked before anything is allocated from it; the payload is opaque bytes (a
`compress` frame, which carries its own checksum, or a handshake field, covered by the
handshake's MAC). ``crc`` is the CRC-32 of the envelope's other 32 bytes and the tag: a bit
flipped in a length, an index or a tag on the way is an error as the message arrives, where it
would otherwise leave the receiver waiting for bytes that never come (until the collective's
deadline). There is no pickle anywhere.

Also here: the memory that payloads and results are received into and reused from
(`BufferPool`).
"""

from __future__ import annotations

import enum
import socket
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Callable

from .errors import PeerDisconnected, WireError

MAGIC = b"DLTP"
VERSION = 2
HEADER = struct.Struct("!4sBBHIIQQI")
_FIELDS = struct.Struct("!4sBBHIIQQ")  # the envelope without its crc
MAX_TAG_BYTES = 256
MAX_INDEX = 1 << 31  # bound on seg / chunk indices


class MsgType(enum.IntEnum):
    """Message types. Handshake types are only valid before authentication, data types after."""

    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    ACCEPT = 4
    REJECT = 5
    RS = 16  # reduce-scatter partial sum of one chunk
    AG = 17  # all-gather: the owner's final frame of one chunk, forwarded verbatim
    ABORT = 18  # the sender aborted this tag; payload is a UTF-8 reason
    PROBE = 19  # bandwidth probe: payload is filler; the receiver answers PROBE_ACK with the same seg
    PROBE_ACK = 20
    GATHER = 21  # all-gather: one member's own frame of one chunk (seg = its ring index), forwarded verbatim


HANDSHAKE_TYPES = frozenset({MsgType.HELLO, MsgType.CHALLENGE, MsgType.PROOF, MsgType.ACCEPT, MsgType.REJECT})
DATA_TYPES = frozenset({MsgType.RS, MsgType.AG, MsgType.ABORT, MsgType.PROBE, MsgType.PROBE_ACK, MsgType.GATHER})


@dataclass(frozen=True, slots=True)
class Message:
    """One decoded message. `payload` is the raw payload bytes."""

    type: MsgType
    tag: str
    seg: int
    chunk: int
    aux: int
    payload: bytes | bytearray | memoryview
    discarded: bool = False  # the payload was read and thrown away unstored (see read_message's admit)


def encode_tag(tag: str) -> bytes:
    """UTF-8 bytes of a tag, checked against MAX_TAG_BYTES."""
    raw = tag.encode("utf-8")
    if len(raw) > MAX_TAG_BYTES:
        raise ValueError(f"tag is {len(raw)} bytes, at most {MAX_TAG_BYTES} allowed: {tag[:40]!r}...")
    return raw


def pack_header(mtype: MsgType, tag: bytes, seg: int, chunk: int, aux: int, payload_len: int) -> bytes:
    """The envelope plus tag bytes for one message whose payload has `payload_len` bytes."""
    fields = _FIELDS.pack(MAGIC, VERSION, int(mtype), len(tag), seg, chunk, aux, payload_len)
    return fields + struct.pack("!I", zlib.crc32(tag, zlib.crc32(fields))) + tag


def check_header_crc(head: bytes, tag: bytes) -> None:
    """WireError unless the envelope's crc matches its other fields and the tag read after it."""
    (stored,) = struct.unpack_from("!I", head, _FIELDS.size)
    computed = zlib.crc32(tag, zlib.crc32(head[:_FIELDS.size]))
    if stored != computed:
        raise WireError(f"message envelope checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): "
                        "corrupted on the way")


def unpack_header(buf: bytes, max_payload: int, allowed: frozenset[MsgType]) -> tuple[MsgType, int, int, int, int, int]:
    """Validate a 36-byte envelope's fields (the crc once the tag is read: ``check_header_crc``);
    returns (type, tag_len, seg, chunk, aux, payload_len)."""
    magic, version, mtype, tag_len, seg, chunk, aux, payload_len, _crc = HEADER.unpack(buf)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r} (not a transport peer?)")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this side speaks {VERSION})")
    try:
        t = MsgType(mtype)
    except ValueError:
        raise WireError(f"unknown message type {mtype}") from None
    if t not in allowed:
        raise WireError(f"message type {t.name} not allowed here")
    if tag_len > MAX_TAG_BYTES:
        raise WireError(f"tag length {tag_len} > {MAX_TAG_BYTES}")
    if seg >= MAX_INDEX or chunk >= MAX_INDEX:
        raise WireError(f"index out of range (seg={seg}, chunk={chunk})")
    if payload_len > max_payload:
        raise WireError(f"payload length {payload_len} > limit {max_payload}")
    return t, tag_len, seg, chunk, aux, payload_len


def recv_exact(sock: socket.socket, n: int, on_bytes: Callable[[int], None] | None = None) -> bytearray:
    """Read exactly n bytes; PeerDisconnected on EOF before that."""
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), on_bytes)
    return buf


def recv_exact_into(sock: socket.socket, view: memoryview, on_bytes: Callable[[int], None] | None = None) -> None:
    """Fill the writable byte view exactly; PeerDisconnected on EOF before that."""
    n = len(view)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerDisconnected(f"connection closed after {got} of {n} bytes")
        got += k
        if on_bytes is not None:
            on_bytes(k)


def read_message(
    sock: socket.socket,
    max_payload: int,
    allowed: frozenset[MsgType],
    on_bytes: Callable[[int], None] | None = None,
    first: bytes | None = None,
    alloc: Callable[[int], memoryview] | None = None,
    admit: Callable[[MsgType, str, int, int, int, int], bool] | None = None,
) -> Message:
    """Read and validate one message. Raises WireError, PeerDisconnected or OSError.

    alloc(n), if given, supplies the writable n-byte view the payload is received into (a
    reused buffer); it is only called with a length the envelope check has bounded.
    admit(type, tag, seg, chunk, aux, payload_len), if given, is asked before any payload byte is
    allocated: it raises WireError for a length the receiver cannot expect, or returns False to
    have the payload read into a small scratch buffer and dropped (`Message.discarded`).
    """
    head = bytes(first) if first is not None else bytes(recv_exact(sock, HEADER.size, on_bytes))
    t, tag_len, seg, chunk, aux, payload_len = unpack_header(head, max_payload, allowed)
    tag_raw = recv_exact(sock, tag_len, on_bytes) if tag_len else b""
    check_header_crc(head, bytes(tag_raw))
    try:
        tag = bytes(tag_raw).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("tag is not valid UTF-8") from None
    if admit is not None and not admit(t, tag, seg, chunk, aux, payload_len):
        discard_exact(sock, payload_len, on_bytes)
        return Message(t, tag, seg, chunk, aux, b"", discarded=True)
    if not payload_len:
        payload: bytes | bytearray | memoryview = b""
    elif alloc is not None:
        payload = alloc(payload_len)
        recv_exact_into(sock, payload, on_bytes)
    else:
        payload = recv_exact(sock, payload_len, on_bytes)
    return Message(t, tag, seg, chunk, aux, payload)


_SCRATCH_BYTES = 64 << 10


def discard_exact(sock: socket.socket, n: int, on_bytes: Callable[[int], None] | None = None) -> None:
    """Read and drop exactly n bytes through a small scratch buffer (nothing sized from n)."""
    scratch = memoryview(bytearray(min(n, _SCRATCH_BYTES)))
    left = n
    while left:
        k = min(left, len(scratch))
        recv_exact_into(sock, scratch[:k], on_bytes)
        left -= k


def read_first_header(sock: socket.socket, on_bytes: Callable[[int], None] | None = None) -> bytes:
    """Read one envelope's bytes, distinguishing a clean EOF at a message boundary (returns b"")."""
    first = sock.recv(HEADER.size)
    if not first:
        return b""
    if on_bytes is not None:
        on_bytes(len(first))
    if len(first) < HEADER.size:
        first += bytes(recv_exact(sock, HEADER.size - len(first), on_bytes))
    return first


def send_message(
    sock: socket.socket, mtype: MsgType, tag: bytes = b"", payload: bytes = b"", seg: int = 0, chunk: int = 0, aux: int = 0
) -> int:
    """Send one small message in one call (handshake use); returns bytes written."""
    data = pack_header(mtype, tag, seg, chunk, aux, len(payload)) + bytes(payload)
    sock.sendall(data)
    return len(data)


def _pinned_bytes(n: int):
    """n bytes of page-locked host memory (a numpy view that keeps its torch tensor alive)."""
    import torch

    return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()


class BufferPool:
    """Reused receive/send buffers for big payloads, so that each chunk of a collective is not a
    fresh allocation (measured: the page faults and zeroing of fresh 1 MiB buffers cost about as
    much as moving the bytes). With pinned=True the buffers are page-locked (CUDA), so frames
    received into them reach the GPU by DMA. Thread-safe.

    get(n) gives a writable n-byte memoryview; put(view) hands it back once nothing reads or
    sends it any more -- exactly once, or two users would share a buffer. A view never put back
    is just garbage-collected. At most `max_bytes` of free buffers are kept.
    """

    def __init__(self, max_bytes: int, min_size: int = 64 << 10, pinned: bool = False) -> None:
        self.max_bytes = max_bytes
        self.min_size = min_size
        self.pinned = pinned
        self._free: dict[int, list] = {}
        self._held = 0
        self._lock = threading.Lock()

    def get(self, n: int) -> memoryview:
        if n >= self.min_size:
            with self._lock:
                free = self._free.get(n)
                if free:
                    self._held -= n
                    return memoryview(free.pop())
            if self.pinned:
                return memoryview(_pinned_bytes(n))
        return memoryview(bytearray(n))

    def put(self, view: memoryview) -> None:
        if not isinstance(view, memoryview):
            return
        buf = view.obj
        n = len(view)
        kind = type(buf).__name__ == "ndarray" if self.pinned else type(buf) is bytearray
        if not kind or len(buf) != n or n < self.min_size or n > self.max_bytes:
            return
        with self._lock:
            # Make room by dropping buffers of other sizes (a collective with another chunk size).
            for size in [s for s in self._free if s != n]:
                while self._free[size] and self._held + n > self.max_bytes:
                    self._free[size].pop()
                    self._held -= size
            if self._held + n <= self.max_bytes:
                self._free.setdefault(n, []).append(buf)
                self._held += n

    def clear(self) -> None:
        """Forget every free buffer (buffers still in use are simply not taken back)."""
        with self._lock:
            self._free.clear()
            self._held = 0
