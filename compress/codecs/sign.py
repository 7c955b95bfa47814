"""sign1: one bit per value (its sign) and one fp32 scale per block, the block's mean |x|.

Biased on its own; use it through ErrorFeedback. Payload: fp32 scales, then the sign bits packed
eight per byte (bit set = sign bit set, so -0.0 decodes as -scale).
"""
from __future__ import annotations

import torch

from ..codec import Codec, Parts
from ..codec_table import register
from .common import OneBlockParam, block_means_, check_scales, n_blocks, padded_blocks
from .packing import pack_bits, unpack_bits


@register
class Sign1(OneBlockParam, Codec):
    """1 bit/value plus 32/block bits of scale; every value decodes to +-(block mean |x|)."""

    name = "sign1"
    codec_id = 8
    requires_error_feedback = True

    def part_layout(self, count: int) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, n_blocks(count, self.block_size)), (torch.uint8, -(-count // 8))]

    def quantize(self, x: torch.Tensor) -> Parts:
        n = x.numel()
        if n == 0:
            return [x.new_empty(0), x.new_empty(0, dtype=torch.uint8)]
        xb = padded_blocks(x, self.block_size)
        scale = xb.abs().sum(dim=1)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError("sign1 cannot encode NaN or infinite values (or a block whose "
                             "sum of magnitudes overflows fp32)")
        scale = block_means_(scale, n, self.block_size)
        negative = (x.view(torch.int32) >> 31).to(torch.int8) & 1  # the sign bit, vectorized
        return [scale, pack_bits(negative.view(torch.uint8))]

    def dequantize(self, parts: Parts, count: int) -> torch.Tensor:
        scale, packed = parts
        if count == 0:
            return torch.empty(0, device=scale.device)
        nb, b = scale.numel(), self.block_size
        signs = unpack_bits(packed, count, zero=1, one=255).view(torch.int8)  # +1 / -1
        if nb * b != count:
            signs = torch.cat([signs, signs.new_zeros(nb * b - count)])
        out = signs.to(torch.float32).view(nb, b).mul_(scale[:, None]).view(-1)
        return out[:count] if nb * b != count else out

    def validate(self, parts: Parts, count: int) -> None:
        check_scales(self.name, parts[0])
