"""Codecs built from a name (``get_codec``) or from a frame header (``decode_frame``, ``peek``)."""
from __future__ import annotations

import torch

from . import codecs, frame
from .codec import Codec, decode_parsed
from .codec_table import _BY_ID, _BY_NAME, available_codecs, codec_name
from .errors import FrameError

_REGISTERS = codecs.__name__  # importing the codecs package registers every codec in codec_table


def get_codec(name: str, **params) -> Codec:
    """Build a codec by name, e.g. ``get_codec("int8", block_size=256, zstd=True)``.

    ValueError for an unknown name, an unknown parameter or a value out of range."""
    cls = _BY_NAME.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}")
    try:
        return cls(**params)
    except TypeError as e:  # unexpected keyword
        raise ValueError(f"bad parameters for codec {name!r}: {e}") from None


def decode_frame(data: bytes | bytearray | memoryview,
                 device: torch.device | str | None = None, count: int | None = None) -> torch.Tensor:
    """Decode any frame, reading the codec and its parameters from the header. FrameError if
    the frame is malformed. With ``count`` (the number of values the caller expects) a frame
    declaring another count is a FrameError before anything is decompressed: pass it for frames
    from a peer, or a small zstd frame can expand to as many values as its header claims (up to
    ``frame.MAX_ELEMENTS``)."""
    h, payload = frame.parse(frame.as_buffer(data))
    cls = _BY_ID.get(h.codec_id)
    if cls is None:
        raise FrameError(f"unknown codec id {h.codec_id} in header")
    if count is not None and h.count != count:
        raise FrameError(f"frame declares {h.count} values, want {count}")
    return decode_parsed(cls, h, payload, device)


def peek(data: bytes | bytearray | memoryview) -> dict:
    """Header facts of a checked frame (codec name, count, byte sizes) without decoding it."""
    h, _ = frame.parse(frame.as_buffer(data))
    return {"codec": codec_name(h.codec_id), "count": h.count, "raw_len": h.raw_len,
            "wire_len": h.wire_len, "zstd": bool(h.flags & frame.FLAG_ZSTD),
            "params": (h.p0, h.p1, h.p2)}
