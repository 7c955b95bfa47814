"""Helpers shared by codec families: parameter checks, blocks, random generators."""
from __future__ import annotations

import math

import torch

from ..errors import FrameError

MAX_BLOCK = 1 << 20


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A fresh generator seeded with ``seed`` (reproducible per call), or None for torch's RNG."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def check_block(name: str, value: object, lo: int = 1, hi: int = MAX_BLOCK,
                multiple: int = 1) -> int:
    """Validate a block-size-like constructor parameter (ValueError)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi or value % multiple:
        extra = f" and a multiple of {multiple}" if multiple > 1 else ""
        raise ValueError(f"{name} must be in [{lo}, {hi}]{extra}, got {value}")
    return value


def header_block(codec: str, name: str, value: int, lo: int = 1, hi: int = MAX_BLOCK,
                 multiple: int = 1) -> int:
    """Validate a block-size-like header field (FrameError)."""
    try:
        return check_block(name, value, lo, hi, multiple)
    except ValueError as e:
        raise FrameError(f"{codec} header: {e}") from None


def n_blocks(count: int, block: int) -> int:
    """Number of blocks of ``block`` values covering ``count`` values."""
    return -(-count // block)


def padded_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as a (n_blocks, block) view, zero-padding the last block if needed (then a copy)."""
    n = x.numel()
    nb = n_blocks(n, block)
    if nb * block == n:
        return x.view(nb, block)
    out = torch.zeros(nb * block, dtype=x.dtype, device=x.device)
    out[:n] = x
    return out.view(nb, block)


def block_means_(sums: torch.Tensor, count: int, block: int) -> torch.Tensor:
    """Per-block sums of ``count`` values in blocks of ``block`` turned into means, in place: the
    last block may be short and is divided by its real length."""
    last = count - (sums.numel() - 1) * block
    lengths = torch.full_like(sums, float(block))  # a tensor: CUDA would multiply by 1 / a number
    if last != block:
        lengths[-1] = last
    return sums.div_(lengths)


def check_scales(codec: str, scales: torch.Tensor) -> None:
    """FrameError unless every scale is finite and >= 0."""
    if scales.numel():
        lo, hi = torch.aminmax(scales)  # NaN anywhere makes both NaN
        if not (float(lo) >= 0.0 and math.isfinite(hi)):
            raise FrameError(f"{codec} frame has a NaN, infinite or negative scale")


class BlockSizeParam:
    """Mixin for codecs whose one header parameter is ``block_size`` (stored in p0)."""

    block_size: int

    @property
    def params(self) -> dict:
        return {"block_size": self.block_size, **super().params}  # type: ignore[misc]

    @property
    def header_params(self) -> tuple[int, int, int]:
        return (self.block_size, 0, 0)



class OneBlockParam(BlockSizeParam):
    """Mixin for codecs whose only parameter is ``block_size`` (default 256): the constructor and
    ``from_header`` of a scale-per-block codec (sign1, int2)."""

    name: str

    def __init__(self, *, block_size: int = 256, **kw) -> None:
        super().__init__(**kw)  # type: ignore[call-arg]
        self.block_size = check_block("block_size", block_size)

    @classmethod
    def from_header(cls, p0: int, p1: int, p2: int):
        header_block(cls.name, "block_size", p0)
        if p1 or p2:
            raise FrameError(f"{cls.name} header has nonzero unused parameters {(p1, p2)}")
        return cls(block_size=p0)
