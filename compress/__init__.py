"""compress: turn fp32 pseudo-gradient chunks into few bytes and back.

Codecs (by name), an error-feedback wrapper, an optional zstd stage and a self-checking wire
frame. No sockets, no models, no pickle. The codecs (torch) load on first use of a name below,
so the torch-free ``codec_spec`` (the codec options and their checks) reads without them.
"""
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .codec import Codec
    from .error_feedback import ErrorFeedback
    from .errors import FrameError
    from .registry import available_codecs, decode_frame, get_codec, peek
    from .zstd_probe import ZstdMeasurement, measure_zstd

_LAZY = {"Codec": ".codec", "ErrorFeedback": ".error_feedback", "FrameError": ".errors",
         "available_codecs": ".registry", "decode_frame": ".registry", "get_codec": ".registry",
         "peek": ".registry", "ZstdMeasurement": ".zstd_probe", "measure_zstd": ".zstd_probe"}

__all__ = ["Codec", "ErrorFeedback", "FrameError", "ZstdMeasurement", "available_codecs",
           "decode_frame", "get_codec", "measure_zstd", "peek"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'compress' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
