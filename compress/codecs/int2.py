"""int2: two bits per value, the 4-level Lloyd-Max quantizer of a Gaussian, one fp32 scale per block.

Each block of ``block_size`` values (default 256) sends its RMS ``s`` (fp32) and, per value, a
sign bit and a magnitude bit: ``|x| <= T*s`` decodes to ``L0*s``, above it to ``L1*s``, with the
optimal levels and threshold of a unit Gaussian (Max 1960: L0 = 0.4528, L1 = 1.5104, T = 0.9816,
the midpoint). 2 + 32/block bits/value (2.125 at 256).

Biased (a block's values all shrink or grow with its outliers), so it runs through error feedback
like ``sign1``: what one exchange does not deliver is sent by the next. Payload: fp32 scales,
then the 2-bit codes packed four per byte, value 4i+j in bits 2j (magnitude) and 2j+1 (sign).
"""
from __future__ import annotations

import torch

from ..codec import Codec, Parts
from ..codec_table import register
from ..errors import FrameError
from .common import OneBlockParam, block_means_, check_scales, n_blocks, padded_blocks
from .packing import packed_bytes

#: Lloyd-Max levels of a unit Gaussian in 4 levels, and the threshold between them (their midpoint)
LEVEL_LOW, LEVEL_HIGH = 0.4528, 1.5104
THRESHOLD = (LEVEL_LOW + LEVEL_HIGH) / 2
#: the largest scale whose high level stays a finite float32 (an encoder clamps to it, a decoder
#: refuses more: values near float32's limit decode at most this far off, never to infinity)
MAX_SCALE = float(torch.finfo(torch.float32).max) / LEVEL_HIGH / (1 + 2 ** -20)
CODE_BITS = 2


@register
class Int2(OneBlockParam, Codec):
    """2 bits/value plus 32/block bits of scale: +-0.4528 or +-1.5104 times the block's RMS."""

    name = "int2"
    codec_id = 11
    requires_error_feedback = True

    def part_layout(self, count: int) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, n_blocks(count, self.block_size)), (torch.uint8, packed_bytes(count, CODE_BITS))]

    def quantize(self, x: torch.Tensor) -> Parts:
        n = x.numel()
        if n == 0:
            return [x.new_empty(0), x.new_empty(0, dtype=torch.uint8)]
        xb = padded_blocks(x, self.block_size)
        magnitude = xb.abs()
        peak = magnitude.amax(dim=1)
        if not bool(torch.isfinite(peak).all()):
            raise ValueError("int2 cannot encode NaN or infinite values")
        unit = torch.where(peak > 0, peak, torch.ones_like(peak))  # RMS of x / peak: no underflow, no overflow
        mean_square = block_means_((magnitude / unit[:, None]).square_().sum(dim=1), n, self.block_size)
        scale = mean_square.sqrt_().mul_(peak).clamp_(max=MAX_SCALE)
        high = (magnitude > THRESHOLD * scale[:, None]).view(torch.uint8).reshape(-1)[:n]
        negative = ((x.reshape(-1).view(torch.int32) >> 31) & 2).to(torch.uint8)  # sign bit: -0.0 decodes negative
        return [scale, _pack2(negative.bitwise_or_(high))]

    def dequantize(self, parts: Parts, count: int) -> torch.Tensor:
        scale, packed = parts
        if count == 0:
            return torch.empty(0, device=scale.device)
        nb, b = scale.numel(), self.block_size
        codes = _unpack2(packed, count)
        table = torch.tensor([LEVEL_LOW, LEVEL_HIGH, -LEVEL_LOW, -LEVEL_HIGH], device=scale.device)
        values = table.index_select(0, codes)
        if nb * b != count:
            values = torch.cat([values, values.new_zeros(nb * b - count)])
        out = values.view(nb, b).mul_(scale[:, None]).view(-1)
        return out[:count] if nb * b != count else out

    def validate(self, parts: Parts, count: int) -> None:
        check_scales(self.name, parts[0])
        if parts[0].numel() and float(parts[0].max()) > MAX_SCALE:
            raise FrameError(f"int2 frame has a block scale above {MAX_SCALE:.4g}, which its encoder never writes "
                             "(its high level would overflow to infinity)")


def _pack2(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 3], four per byte: code 4i+j in bits 2j and 2j+1 of byte i."""
    n = codes.numel()
    if n % 4:
        codes = torch.cat([codes, codes.new_zeros(4 - n % 4)])
    q = codes.view(-1, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def _unpack2(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of ``_pack2``: ``count`` int64 codes in [0, 3]."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)[:count].to(torch.int64)
