"""Helpers for the tests that run on a CUDA device (importable from every test folder)."""

from __future__ import annotations

import torch


def sleep_on_cuda_stream(seconds: float) -> None:
    """Queue a kernel that spins for about `seconds` on the current CUDA stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 1_000_000 / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(cycles_per_ms * seconds * 1000))
