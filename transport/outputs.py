"""Output buffers of collectives (``out=``, ``sent=``): which tensors a collective may write into."""

from __future__ import annotations

import torch


def check_out(out: torch.Tensor, x: torch.Tensor) -> None:
    """Refuse an output buffer the collective cannot write its result into."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.shape != x.shape:
        raise ValueError(f"out must be a float32 tensor of shape {tuple(x.shape)}, "
                         f"got {getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}")
    if not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be contiguous and on {x.device}")
    if overlaps(out, x):
        raise ValueError("out must not overlap x: x stays intact if the collective fails")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two float32 tensors share any memory (by address range)."""
    if not a.numel() or not b.numel():
        return False
    return a.data_ptr() < b.data_ptr() + 4 * b.numel() and b.data_ptr() < a.data_ptr() + 4 * a.numel()
