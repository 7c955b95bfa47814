"""The table of registered codecs: each codec class by its name and by its wire id (one header byte)."""
from __future__ import annotations

from typing import TypeVar

# codec classes (subclasses of ``compress.codec.Codec``, which imports this table for its errors)
C = TypeVar("C", bound=type)

_BY_NAME: dict[str, type] = {}
_BY_ID: dict[int, type] = {}


def register(cls: C) -> C:
    """Class decorator: make a codec available by its ``name`` and wire ``codec_id``."""
    if cls.name in _BY_NAME or cls.codec_id in _BY_ID:
        raise ValueError(f"codec {cls.name!r} / id {cls.codec_id} registered twice")
    if not 0 < cls.codec_id < 256:
        raise ValueError(f"codec id {cls.codec_id} does not fit the header byte")
    _BY_NAME[cls.name] = cls
    _BY_ID[cls.codec_id] = cls
    return cls


def available_codecs() -> list[str]:
    """Names accepted by :func:`get_codec`, in wire-id order."""
    return [c.name for _, c in sorted(_BY_ID.items())]


def codec_name(codec_id: int) -> str:
    """Name of a wire codec id (or a description of an unknown one)."""
    cls = _BY_ID.get(codec_id)
    return cls.name if cls else f"<unknown id {codec_id}>"
