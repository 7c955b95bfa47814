"""The wire frame: a fixed little-endian header, a payload and an XXH3-64 checksum trailer.

Layout (version 1), all integers little-endian::

    offset size field
    0      4    magic b"DLCF"
    4      1    version (1)
    5      1    codec id (see registry)
    6      1    flags: bit0 zstd, bit1 byte-shuffled before zstd; other bits must be 0
    7      1    reserved, must be 0
    8      4    p0  codec parameter (block size / chunk size, 0 if unused)
    12     4    p1  codec parameter (top-k: k)
    16     4    p2  codec parameter (top-k: value bits)
    20     8    count: number of fp32 elements encoded
    28     8    raw_len: payload bytes before the entropy stage
    36     8    wire_len: payload bytes in this frame
    44     wire_len payload
    44+wl  8    XXH3-64 checksum of every byte before it (xxhash, seed 0)

Only this module reads or writes those bytes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from .errors import FrameError

MAGIC = b"DLCF"
VERSION = 1
HEADER = struct.Struct("<4sBBBBIIIQQQ")
HEADER_SIZE = HEADER.size  # 44 bytes
TRAILER_SIZE = 8
_CHECK = struct.Struct("<Q")
OVERHEAD = HEADER_SIZE + TRAILER_SIZE

FLAG_ZSTD = 1
FLAG_SHUFFLE = 2
KNOWN_FLAGS = FLAG_ZSTD | FLAG_SHUFFLE

#: Largest element count a frame may declare (fp32 output of 4 GiB). Decoding refuses larger
#: frames before allocating; raise it here if a deployment really sends bigger chunks.
MAX_ELEMENTS = 1 << 30


@dataclass(frozen=True)
class Header:
    """The parsed, length-checked fields of a frame header."""

    codec_id: int
    flags: int
    p0: int
    p1: int
    p2: int
    count: int
    raw_len: int
    wire_len: int


def pack_header(h: Header) -> bytes:
    """Serialize a header (44 bytes)."""
    return HEADER.pack(MAGIC, VERSION, h.codec_id, h.flags, 0, h.p0, h.p1, h.p2,
                       h.count, h.raw_len, h.wire_len)


def write_header(buf: memoryview, h: Header) -> None:
    """Write a header into the first 44 bytes of a writable buffer."""
    HEADER.pack_into(buf, 0, MAGIC, VERSION, h.codec_id, h.flags, 0, h.p0, h.p1, h.p2,
                     h.count, h.raw_len, h.wire_len)


def checksum(data: memoryview) -> int:
    """The frame checksum (XXH3-64) of some bytes."""
    return xxhash.xxh3_64_intdigest(data)


def trailer(*parts: bytes | bytearray | memoryview) -> bytes:
    """The 8-byte checksum trailer of a frame whose bytes before it are ``parts``, in order.

    For a frame sent as several buffers (a header, then a payload that stays where it is)."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return _CHECK.pack(h.intdigest())


def seal(buf: memoryview) -> None:
    """Write the checksum of ``buf[:-8]`` into its last 8 bytes."""
    _CHECK.pack_into(buf, len(buf) - TRAILER_SIZE, checksum(buf[:-TRAILER_SIZE]))


def as_buffer(frame: object) -> memoryview:
    """A flat byte view of ``frame``; FrameError if it is not bytes-like."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise FrameError("a frame must be bytes, bytearray or memoryview, "
                         f"not {type(frame).__name__}")
    mv = memoryview(frame)
    if not mv.c_contiguous:
        raise FrameError("frame memoryview is not contiguous")
    if mv.format != "B" or mv.ndim != 1:
        try:
            mv = mv.cast("B")
        except TypeError as e:  # odd formats memoryview cannot reinterpret
            raise FrameError(f"frame memoryview cannot be read as bytes: {e}") from None
    return mv


def parse(mv: memoryview) -> tuple[Header, memoryview]:
    """Check magic, version, flags, lengths and checksum; return the header and wire payload.

    Every length is checked against the actual buffer before anything is sized from it.
    """
    n = len(mv)
    if n < OVERHEAD:
        raise FrameError(f"frame is {n} bytes, shorter than the {OVERHEAD}-byte header and trailer")
    magic, version, codec_id, flags, reserved, p0, p1, p2, count, raw_len, wire_len = \
        HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a compress frame")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this build reads {VERSION})")
    if flags & ~KNOWN_FLAGS:
        raise FrameError(f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:02x} in header")
    if flags & FLAG_SHUFFLE and not flags & FLAG_ZSTD:
        raise FrameError("shuffle flag set without zstd flag")
    if reserved != 0:
        raise FrameError(f"reserved header byte is {reserved}, expected 0")
    if count > MAX_ELEMENTS:
        raise FrameError(f"frame declares {count} elements, more than MAX_ELEMENTS={MAX_ELEMENTS}")
    expected = OVERHEAD + wire_len
    if n != expected:
        what = "truncated" if n < expected else "has trailing bytes"
        raise FrameError(f"frame is {n} bytes but its header says {expected} "
                         f"({wire_len}-byte payload): {what}")
    (stored,) = _CHECK.unpack_from(mv, n - TRAILER_SIZE)
    actual = checksum(mv[:-TRAILER_SIZE])
    if stored != actual:
        raise FrameError(f"checksum mismatch (stored 0x{stored:016x}, computed 0x{actual:016x}): "
                         "frame corrupted")
    if not flags & FLAG_ZSTD and raw_len != wire_len:
        raise FrameError(f"uncompressed frame with raw_len {raw_len} != wire_len {wire_len}")
    h = Header(codec_id, flags, p0, p1, p2, count, raw_len, wire_len)
    return h, mv[HEADER_SIZE:n - TRAILER_SIZE]
