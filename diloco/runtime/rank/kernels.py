"""Which code a worker's codec runs: the C kernels of ``compress/_native.c`` or the torch path.

The block codecs (int8, int4, fp4-*, lloyd4) and the round hash run in C where the extension was
built (``pip install`` compiles it; the image's build fails without it) and in torch otherwise,
with the same bits but tens of times slower (int4 encodes 3.4 GB/s in C against 0.04 GB/s in
torch on one core of the 2-core test machine). ``describe`` says which, once at start, so a slow
path is never silent.
"""

from __future__ import annotations

import os

# codecs whose frames the C kernels code (the others are casts torch does at memory speed)
NATIVE_CODECS = ("int8", "int4", "fp4-e2m1", "fp4-e3m0", "lloyd4")


def describe(codec: str) -> tuple[str, str]:
    """``(kernels, sentence)``: kernels is ``native`` or ``torch``; the sentence says why, for the
    start line of a worker running ``codec``."""
    from compress.codecs import blockwise

    if blockwise.native_available():
        where = getattr(blockwise._native, "__file__", "compress._native")
        used = "its frames and " if codec in NATIVE_CODECS else ""
        return "native", f"codec {codec}: {used}the round hash run in the C kernels ({os.path.basename(where)})"
    if not blockwise.USE_NATIVE:
        why = "COMPRESS_NATIVE=0 turned them off"
    else:
        why = "they are not built (pip install needs a C compiler and Python's headers)"
    slow = " (its frames code tens of times slower)" if codec in NATIVE_CODECS else ""
    return "torch", f"codec {codec}: the torch path, not the C kernels: {why}{slow}"
