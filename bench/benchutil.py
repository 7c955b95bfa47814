"""Small helpers shared by the benchmarks (not a benchmark)."""
from __future__ import annotations

import ctypes


def pin_malloc() -> str:
    """Stop glibc from returning freed buffers to the OS between calls (and re-faulting them):
    sets M_MMAP_THRESHOLD to 32 MiB and M_TRIM_THRESHOLD to 1 GiB in this process. Without it a
    plain tensor clone() swings between 3 and 40 GB/s from run to run on the 2-core machine.
    Returns a description of the setting in force."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, 32 << 20) and libc.mallopt(-1, 1 << 30)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        return "pinned: M_MMAP_THRESHOLD=32MiB, M_TRIM_THRESHOLD=1GiB" if ok else "default"
    except OSError:
        return "default"
