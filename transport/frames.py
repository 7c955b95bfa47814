"""Codec frames as the ring collectives handle them: the default codec, how large a chunk's frame
can be, and the in-place fast path for raw fp32 frames."""

from __future__ import annotations

import logging
from typing import Any

import torch

import compress
from compress import frame

log = logging.getLogger(__name__)


def default_codec() -> Any:
    """The lossless fp32 codec of `compress`."""
    return compress.get_codec("fp32")


def decodes_into(codec: Any) -> bool:
    """Whether codec is one of compress's, whose decode and encode_with_decoded take out=."""
    return isinstance(codec, compress.Codec)


def _zstd_bound(nbytes: int) -> int:
    """zstd's worst-case compressed size of nbytes (ZSTD_COMPRESSBOUND, rounded up generously)."""
    return nbytes + (nbytes >> 8) + (128 << 10 >> 11) + 64


def frame_bound(codec: Any, fallback: int) -> Any:
    """count -> the largest frame, in bytes, that codec can send for count values.

    Exact for compress's codecs (header, payload, checksum; zstd's worst-case expansion allowed);
    any other codec is bounded by `fallback` (the transport's max_chunk_frame_bytes)."""
    if not isinstance(codec, compress.Codec):
        return lambda count: fallback
    return lambda count: frame.OVERHEAD + _zstd_bound(codec.payload_size(count))


class RawFp32:
    """In-place framing for compress's lossless fp32 codec without zstd.

    Its frame payload is the raw little-endian fp32 values, so the ring can add into a received
    frame and re-seal it instead of decoding to a new tensor and encoding to new bytes, and can
    send a frame of a tensor's own memory between a separate header and trailer. Frames are still
    written and checked only by `compress.frame` (pack_header, trailer, seal, and parse, which
    verifies the checksum). `raw_fp32` checks the result byte for byte against the codec's own
    encode/decode before using it; any other codec takes the generic decode/encode path.
    """

    def __init__(self, codec: Any) -> None:
        self.codec = codec
        self._params = tuple(codec.header_params)

    def parts(self, values: torch.Tensor) -> list[bytes | memoryview]:
        """The frame of a contiguous CPU fp32 tensor as [header, the tensor's own memory, trailer]:
        sent as is, with no copy (values must not change until it is sent)."""
        count = values.numel()
        raw_len = self.codec.payload_size(count)
        head = frame.pack_header(frame.Header(self.codec.codec_id, 0, *self._params, count, raw_len, raw_len))
        body = memoryview(values.numpy()).cast("B")
        return [head, body, frame.trailer(head, body)]

    def values(self, buf: Any, want: int) -> torch.Tensor | None:
        """A writable fp32 view of the checked frame's payload; None if it is not a raw fp32 frame
        of want values in a writable buffer. Raises compress.FrameError for a malformed frame."""
        if not isinstance(buf, memoryview) or buf.readonly:
            return None
        h, payload = frame.parse(buf)
        c = self.codec
        got = (h.codec_id, h.flags, (h.p0, h.p1, h.p2), h.count, h.raw_len)
        if got != (c.codec_id, 0, self._params, want, c.payload_size(want)):
            return None
        return torch.frombuffer(payload, dtype=torch.float32)

    def seal(self, buf: memoryview) -> None:
        """Rewrite the checksum after the payload was changed in place."""
        frame.seal(buf)


_raw_checked: dict[Any, bool] = {}


def raw_fp32(codec: Any) -> RawFp32 | None:
    """A `RawFp32` for codec if it is compress's fp32 codec without zstd and passes the check."""
    if not isinstance(codec, compress.Codec) or codec.name != "fp32" or codec.zstd:
        return None
    raw = RawFp32(codec)
    key = (type(codec), raw._params)
    if key not in _raw_checked:
        _raw_checked[key] = _raw_matches(codec, raw)
    return raw if _raw_checked[key] else None


def _raw_matches(codec: Any, raw: RawFp32) -> bool:
    x = torch.tensor([1.0, -2.5, 3.0e38, 1e-40, -0.0, 7.25], dtype=torch.float32)
    try:
        ref = codec.encode(x)
        back = raw.values(memoryview(bytearray(ref)), x.numel())
        if b"".join(raw.parts(x)) != bytes(ref) or back is None:
            return False
        return torch.equal(back.view(torch.int32), codec.decode(ref).view(torch.int32))
    except Exception:
        log.exception("raw fp32 framing check failed; using the codec's encode/decode")
        return False
