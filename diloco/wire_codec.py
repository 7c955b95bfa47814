"""The wire codec the transport options name (``--codec``, ``--codec-block``, ``--topk-density``,
``--codec-fast``, ``--zstd``, ``--zstd-level``): built by ``diloco.connect`` and bench runs, and
tried by ``Config.validate``, which must stay torch-free, hence ``compress`` is imported on call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compress import Codec
    from diloco.config import TransportConfig


def make_codec(t: TransportConfig) -> Codec:
    """The ``compress`` codec the transport settings name (ValueError if it cannot be made)."""
    import compress

    params: dict[str, Any] = {"zstd": t.zstd, "zstd_level": t.zstd_level}
    if t.codec_block:
        params["chunk" if t.codec == "topk" else "block_size"] = t.codec_block
    if t.codec == "topk" and t.topk_density:
        params["density"] = t.topk_density
    if t.codec_fast:
        if "search" not in compress.get_codec(t.codec).params:
            raise ValueError(f"--codec-fast applies to the 4-bit codecs (int4, fp4-e2m1, fp4-e3m0, lloyd4) only, "
                             f"not {t.codec}")
        params["search"] = False
    return compress.get_codec(t.codec, **params)
