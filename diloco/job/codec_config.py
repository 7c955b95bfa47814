"""The ``compress`` codec a job's transport settings name (``--codec`` and its options, and
``--final-codec``): built on call, so importing this module stays torch-free."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from diloco.job.auto_choice import AUTO

if TYPE_CHECKING:
    from compress import Codec


class TransportConfig(Protocol):
    """What of ``diloco.job.config.TransportConfig`` (a dataclass) the codec is built from."""

    codec: str
    final_codec: str
    codec_block: int
    topk_density: float
    codec_fast: bool
    zstd: bool
    zstd_level: int


def make_final_codec(t: TransportConfig) -> Codec | None:
    """The codec of the last exchange (``--final-codec``, at its own defaults), or None."""
    return make_codec(dataclasses.replace(t, codec=t.final_codec, codec_block=0, topk_density=0.0, codec_fast=False)) \
        if t.final_codec else None


def plain_fp32(t: TransportConfig) -> bool:
    """fp32 without any codec option: nothing for ``make_codec`` to check."""
    return t.codec == "fp32" and not (t.codec_block or t.topk_density or t.codec_fast or t.zstd)


def make_codec(t: TransportConfig) -> Codec:
    """The ``compress`` codec the transport settings name (ValueError if it cannot be made); ``compress``
    (torch) is imported on call, so importing this module stays torch-free, and so does validating a
    config of plain fp32 (the default)."""
    import compress

    if t.codec == AUTO:
        raise ValueError("auto is not a codec: the worker chooses one from the measured link (auto_choice.apply_choice)")
    knobs = compress.get_codec(t.codec).params  # ValueError for an unknown name
    params: dict[str, Any] = {"zstd": t.zstd, "zstd_level": t.zstd_level}
    if t.codec_block:
        key = "chunk" if t.codec == "topk" else "block_size"
        if key not in knobs:
            blocked = [n for n in compress.available_codecs() if {"block_size", "chunk"} & set(compress.get_codec(n).params)]
            raise ValueError(f"--codec-block applies to the codecs with scale blocks or chunks ({', '.join(blocked)}), "
                             f"not {t.codec}")
        params[key] = t.codec_block
    if t.codec == "topk" and t.topk_density:
        params["density"] = t.topk_density
    if t.codec_fast:
        if "search" not in knobs:
            raise ValueError(f"--codec-fast applies to the 4-bit codecs (int4, fp4-e2m1, fp4-e3m0, lloyd4) only, "
                             f"not {t.codec}")
        params["search"] = False
    return compress.get_codec(t.codec, **params)
