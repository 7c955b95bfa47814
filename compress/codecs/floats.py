"""Plain float casts: fp32 (lossless) and bf16 / fp16 (optionally stochastic rounding)."""
from __future__ import annotations

import torch

from ..codec import Codec, Parts
from ..codec_table import register
from .common import make_generator


@register
class FP32(Codec):
    """Lossless: the raw little-endian fp32 bytes (32 bits/value)."""

    name = "fp32"
    codec_id = 1
    shuffle_width = 4

    def part_layout(self, count: int) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, count)]

    def quantize(self, x: torch.Tensor) -> Parts:
        return [x]

    def dequantize(self, parts: Parts, count: int) -> torch.Tensor:
        return parts[0].clone()


class _Half(Codec):
    """A 16-bit float cast, round-to-nearest-even or stochastic."""

    dtype: torch.dtype
    shuffle_width = 2

    def part_layout(self, count: int) -> list[tuple[torch.dtype, int]]:
        return [(self.dtype, count)]

    def quantize(self, x: torch.Tensor) -> Parts:
        if not self.stochastic or x.numel() == 0:
            return [x.to(self.dtype)]
        return [self._stochastic(x)]

    def dequantize(self, parts: Parts, count: int) -> torch.Tensor:
        return parts[0].float()

    def _stochastic(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # only bf16 rounds stochastically


@register
class BF16(_Half):
    """bfloat16 cast (16 bits/value): fp32 with the low 16 mantissa bits rounded away."""

    name = "bf16"
    codec_id = 2
    dtype = torch.bfloat16
    supports_stochastic = True

    def _stochastic(self, x: torch.Tensor) -> torch.Tensor:
        # Adding uniform noise below bit 16 then truncating rounds up with probability equal to
        # the dropped fraction. Non-finite values are cast normally.
        g = make_generator(self.seed, x.device)
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=g)
        bits = x.view(torch.int32) + noise
        y = (bits >> 16).to(torch.int16).view(torch.bfloat16)
        return torch.where(torch.isfinite(x) & torch.isfinite(y.float()), y, x.to(torch.bfloat16))


@register
class FP16(_Half):
    """IEEE half cast (16 bits/value); values beyond +-65504 become inf. Prefer bf16 for
    pseudo-gradients, whose small magnitudes fall into fp16 subnormals."""

    name = "fp16"
    codec_id = 3
    dtype = torch.float16
