"""Blockwise absmax-scaled codecs: int8, int4, fp4-e2m1, fp4-e3m0.

Each block of ``block_size`` values gets one fp32 scale; values are coded relative to it. Payload:
fp32 scales (one per block), then the codes: int8 one byte each; 4-bit codes two per byte,
element 2i in the low nibble. int4 nibbles are offset binary (code = q + 8, q in [-7, 7]); the
4-bit float nibbles are sign-magnitude (bit 3 = sign, bits 0-2 = E2M1 or E3M0 magnitude).

Scales are never below 2^-100 / qmax, so they stay normal floats; values in blocks smaller than
that are coded against that floor (absolute error below 2^-100). A decoder therefore refuses
(FrameError) a scale that is zero or below that floor, above the largest the encoder can write
(float32 max / q), NaN, infinite or negative -- none can come from an encoder, and a zero scale
would silently turn any codes into zeros -- and, where a scale is so large that a code the
encoder never writes (int8 -128, int4 nibble 0) would overflow, that code.

On CPU, round-to-nearest encoding and 4-bit decoding run in the optional C kernels of
``compress/_native.c`` when they are built (``pip install -e .``): one pass per block instead of
a dozen torch ops, with the same bits as the torch code below, which stays the reference and the
path for other devices (and for stochastic rounding).
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from ..codec import Codec, Parts
from ..errors import FrameError
from ..registry import register
from .common import (BlockSizeParam, check_block, check_scales, header_block, make_generator, n_blocks,
                     padded_blocks)
from .packing import pack_nibbles, unpack_nibbles

TINY = 2.0 ** -100
FLT_MAX = float(torch.finfo(torch.float32).max)
#: Adding 1.5 * 2^23 to a float of magnitude < 2^22 rounds it to an integer (half to even) that
#: then sits in the low bits of the sum's int32 view.
MAGIC = 12582912.0

try:
    from .. import _native
except ImportError:  # not built: the torch path does everything
    _native = None

#: False forces the torch path on CPU as well (tests compare the two); the environment variable
#: COMPRESS_NATIVE=0 sets it at import.
USE_NATIVE = os.environ.get("COMPRESS_NATIVE", "1") != "0"


def native_available() -> bool:
    """Whether the C kernels were built and are enabled."""
    return _native is not None and USE_NATIVE


def _native_for(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and native_available()


class BlockScaled(BlockSizeParam, Codec):
    """Shared machinery: absmax scale per block, codes per value, optional stochastic rounding."""

    default_block: int = 256
    bits: int = 8
    #: the largest code magnitude (what the absmax maps to with stochastic rounding)
    qmax: float = 127.0
    #: what the block's absmax maps to with round-to-nearest; above ``qmax`` by up to half the
    #: top gap, so clipped values err no more than rounding does and every step shrinks
    q_nearest: float = 127.0

    supports_stochastic = True
    #: which kernel of ``_native.encode`` codes this family (None: torch only), and the constant
    #: it adds after scaling (int codecs: MAGIC + offset)
    native_kind: int | None = None
    native_add: float = 0.0

    def __init__(self, *, block_size: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.block_size = check_block("block_size", self.default_block if block_size is None
                                      else block_size, lo=2 if self.bits == 4 else 1,
                                      multiple=2 if self.bits == 4 else 1)

    @classmethod
    def from_header(cls, p0: int, p1: int, p2: int) -> "BlockScaled":
        multiple = 2 if cls.bits == 4 else 1
        header_block(cls.name, "block_size", p0, lo=multiple, multiple=multiple)
        if p1 or p2:
            raise FrameError(f"{cls.name} header has nonzero unused parameters {(p1, p2)}")
        return cls(block_size=p0)

    def part_layout(self, count: int) -> list[tuple[torch.dtype, int]]:
        codes = count if self.bits == 8 else -(-count // 2)
        return [(torch.float32, n_blocks(count, self.block_size)),
                (torch.int8 if self.bits == 8 else torch.uint8, codes)]

    def quantize(self, x: torch.Tensor) -> Parts:
        n = x.numel()
        if n == 0:
            return [x.new_empty(0), x.new_empty(0, dtype=self.part_layout(0)[1][0])]
        if (not self.stochastic and self.native_kind is not None and _native_for(x)
                and x.dtype == torch.float32):
            return self._quantize_native(x)
        xb = padded_blocks(x, self.block_size)
        xa = xb.abs()
        absmax = xa.amax(dim=1)
        if not math.isfinite(absmax.max()):
            raise ValueError(f"{self.name} cannot encode NaN or infinite values")
        q = self.qmax if self.stochastic else self.q_nearest
        # the floor keeps scales normal floats; zero blocks still code as 0
        scale = absmax.clamp_(min=TINY).div_(q)
        inv = torch.reciprocal(scale)
        if self.code_gain() != 1.0:
            inv.mul_(self.code_gain())
        inv = inv[:, None]
        noise = None
        if self.stochastic:
            noise = torch.rand(xb.shape, device=x.device,
                               generator=make_generator(self.seed, x.device))
        codes = self.code_blocks(xb, xa, inv, noise).reshape(-1)[:n]
        return [scale, codes if self.bits == 8 else pack_nibbles(codes.to(torch.int8), False)]

    def _quantize_native(self, x: torch.Tensor) -> Parts:
        """``quantize`` (round to nearest) by the C kernel: the same scales and codes."""
        x = x.contiguous()  # (the pointers below must outlive the call: keep the tensors)
        n = x.numel()
        (_, nb), (code_dtype, nc) = self.part_layout(n)
        scale = torch.empty(nb)
        codes = torch.empty(nc, dtype=code_dtype)
        bad = _native.encode(self.native_kind, x.data_ptr(), n, self.block_size, self.q_nearest,
                             self.code_gain(), self.native_add, scale.data_ptr(),
                             codes.data_ptr())
        if bad:
            raise ValueError(f"{self.name} cannot encode NaN or infinite values")
        return [scale, codes]

    def dequantize(self, parts: Parts, count: int) -> torch.Tensor:
        scale, codes = parts
        if count == 0:
            return torch.empty(0, device=scale.device)
        if self.bits == 4 and _native_for(codes):
            return self._dequantize_native(scale, codes, count)
        values = self.values(codes, count)
        nb, b = scale.numel(), self.block_size
        if nb * b != count:
            padded = values.new_zeros(nb * b)
            padded[:count] = values
            values = padded
        out = values.view(nb, b).mul_(self.value_scale(scale)[:, None]).view(-1)
        return out[:count] if nb * b != count else out

    def dequantize_into(self, parts: Parts, count: int, out: torch.Tensor) -> torch.Tensor:
        scale, codes = parts
        if count and self.bits == 4 and _native_for(codes) and out.device.type == "cpu":
            return self._dequantize_native(scale, codes, count, out)
        return out.copy_(self.dequantize(parts, count))

    def _dequantize_native(self, scale: torch.Tensor, codes: torch.Tensor,
                           count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """4-bit ``dequantize`` by the C kernel: nibble -> ``nibble_values()`` x value scale
        (into ``out``, a contiguous fp32 CPU tensor of ``count`` values, if given)."""
        if (scale.numel() != n_blocks(count, self.block_size) or codes.numel() != -(-count // 2)
                or codes.dtype != torch.uint8 or scale.dtype != torch.float32):
            raise AssertionError("4-bit parts do not match the part layout")
        table = self.__dict__.get("_nibble_table")
        if table is None:
            table = self.__dict__.setdefault("_nibble_table", self.nibble_values())
        codes, vscale = codes.contiguous(), self.value_scale(scale).contiguous()
        if out is None:
            out = torch.empty(count)
        _native.decode4(codes.data_ptr(), count, self.block_size, table.data_ptr(),
                        vscale.data_ptr(), out.data_ptr())
        return out

    def validate(self, parts: Parts, count: int) -> None:
        check_scales(self.name, parts[0])
        scale = parts[0]
        if not scale.numel():
            return
        lo, hi = (float(v) for v in torch.aminmax(scale))
        floor, ceiling = self.scale_bounds()
        if lo < floor:
            raise FrameError(f"{self.name} frame has a scale of {lo:g}, below the smallest its encoder writes "
                             f"({floor:g} = 2^-100 / {max(self.qmax, self.q_nearest):g}): a zero or tiny scale "
                             "would decode its block's codes to 0 instead of their values")
        if hi > ceiling:
            raise FrameError(f"{self.name} frame has a scale of {hi:g}, above the largest its encoder writes "
                             f"({ceiling:g} = float32 max / {min(self.qmax, self.q_nearest):g})")
        self.validate_codes(parts, count, hi)

    def scale_bounds(self) -> tuple[float, float]:
        """(smallest, largest) scale the encoder writes, under either rounding (fp32, as it computes them)."""
        bounds = self.__dict__.get("_scale_bounds")
        if bounds is None:
            qs = torch.tensor([self.qmax, self.q_nearest], dtype=torch.float32)
            floor = float((torch.tensor(TINY, dtype=torch.float32) / qs).min())
            ceiling = float((torch.tensor(FLT_MAX, dtype=torch.float32) / qs).max())
            bounds = self.__dict__.setdefault("_scale_bounds", (floor, ceiling))
        return bounds

    def validate_codes(self, parts: Parts, count: int, max_scale: float) -> None:
        """Raise FrameError for codes the encoder never writes, where they could decode to +-inf
        (``max_scale``: the frame's largest scale). Default: every code is one it may write."""

    # ---- per family ----
    def code_blocks(self, xb: torch.Tensor, xa: torch.Tensor, inv: torch.Tensor,
                    noise: torch.Tensor | None) -> torch.Tensor:
        """Integer codes whose low byte is the code (same shape as the blocks ``xb``;
        ``xa`` = |xb|, a scratch copy it may overwrite; ``inv`` = code units per input unit,
        per block)."""
        raise NotImplementedError

    def values(self, codes: torch.Tensor, count: int) -> torch.Tensor:
        """A new fp32 tensor: ``count`` payload codes in units of ``value_scale(scale)``."""
        raise NotImplementedError

    def value_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """What ``values`` are multiplied by, per block."""
        return scale

    def code_gain(self) -> float:
        """Extra factor on ``inv`` that ``code_blocks`` relies on (1 unless it says)."""
        return 1.0

    def nibble_values(self) -> torch.Tensor:
        """4-bit codecs: the 16 fp32 values ``values`` decodes each nibble to (CPU)."""
        raise NotImplementedError


def _round_to_int(y: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """round(y) + offset in the low byte of an int32 tensor (|y + offset| <= 127), consuming y;
    converting it to int8 keeps exactly that byte."""
    return y.add_(MAGIC + offset).view(torch.int32)


def _signbit8(xb: torch.Tensor) -> torch.Tensor:
    """8 where x is negative (sign bit set), else 0, as int32."""
    return (xb.view(torch.int32) >> 28) & 8


class _IntBlock(BlockScaled):
    offset: float = 0.0
    #: the code the encoder never writes (int8 -128, int4 nibble 0 = -8) and its magnitude
    unused_code: int = -128
    unused_magnitude: float = 128.0

    def validate_codes(self, parts: Parts, count: int, max_scale: float) -> None:
        if max_scale * self.unused_magnitude <= FLT_MAX:
            return  # no code can overflow: nothing to check (the usual case, at no cost)
        codes = parts[1] if self.bits == 8 else unpack_nibbles(parts[1], count)
        if bool((codes == self.unused_code).any()):
            raise FrameError(f"{self.name} frame has a code its encoder never writes ({self.unused_code}) "
                             "in a block whose scale would make it overflow to infinity")

    def code_blocks(self, xb, xa, inv, noise):
        y = torch.mul(xb, inv, out=xa)  # |xb| is not needed any more: reuse its memory
        if noise is not None:  # round(y + u - 1/2) = floor(y + u): unbiased
            y.add_(noise).sub_(0.5).clamp_(-self.qmax, self.qmax)
        return _round_to_int(y, self.offset)


@register
class Int8(_IntBlock):
    """Symmetric int8 in [-127, 127], fp32 absmax scale per block (8 + 32/block bits/value)."""

    name = "int8"
    codec_id = 4
    default_block = 256
    bits = 8
    qmax = 127.0
    q_nearest = 127.0
    native_kind = 0
    native_add = MAGIC

    def values(self, codes, count):
        return codes.to(torch.float32)


@register
class Int4(_IntBlock):
    """Symmetric int4 in [-7, 7], fp32 scale per block (4 + 32/block bits/value); the absmax
    maps to 7.49 (7 with stochastic rounding)."""

    name = "int4"
    codec_id = 5
    default_block = 128
    bits = 4
    qmax = 7.0
    q_nearest = 7.49
    offset = 8.0
    unused_code = 0  # nibble 0 = -8
    unused_magnitude = 8.0
    native_kind = 1
    native_add = MAGIC + 8.0

    def values(self, codes, count):
        return unpack_nibbles(codes, count).view(torch.int8).sub_(8).to(torch.float32)

    def nibble_values(self):
        return torch.arange(16, dtype=torch.float32) - 8


class _FP4(BlockScaled):
    """Sign-magnitude 4-bit floats, decoded by placing the nibble's bits into an fp16."""

    bits = 4
    default_block = 128
    #: bit position of the magnitude's 3 bits inside the fp16, and the power of two by which
    #: that fp16 undershoots the real level
    fp16_shift: int
    fp16_exp: int
    #: scales at or above this cannot be decoded without overflow
    max_scale = 2.0 ** 100

    def quantize(self, x: torch.Tensor) -> Parts:
        parts = super().quantize(x)
        if parts[0].numel() and bool((parts[0] >= self.max_scale).any()):
            raise ValueError(f"{self.name} cannot encode a block whose scale reaches 2^100 "
                             "(magnitudes around 1e30 and up)")
        return parts

    def validate(self, parts: Parts, count: int) -> None:
        super().validate(parts, count)
        if parts[0].numel() and bool((parts[0] >= self.max_scale).any()):
            raise FrameError(f"{self.name} frame has a scale of 2^100 or more")

    def values(self, codes, count):
        # one table lookup per packed byte yields both of its values as an fp16 pair
        table = self._pair_table(codes.device)
        pairs = table.index_select(0, codes.to(torch.int32))
        return pairs.view(torch.float16)[:count].to(torch.float32)

    def _pair_table(self, device: torch.device) -> torch.Tensor:
        tables = self.__dict__.setdefault("_tables", {})
        if device not in tables:
            nib = torch.arange(16, dtype=torch.int32)
            half = ((nib & 8) << 12) | ((nib & 7) << self.fp16_shift)  # fp16 bits per nibble
            pair = half.repeat(16) | (half.repeat_interleave(16) << 16)  # byte = lo | hi << 4
            tables[device] = pair.to(device)
        return tables[device]

    def value_scale(self, scale):
        return scale * 2.0 ** self.fp16_exp

    def nibble_values(self):
        nib = torch.arange(16, dtype=torch.int32)
        half = ((nib & 8) << 12) | ((nib & 7) << self.fp16_shift)
        return half.to(torch.int16).view(torch.float16).to(torch.float32)


@register
class FP4E2M1(_FP4):
    """4-bit float E2M1 (OCP MXFP4 element): magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} x scale,
    scale = absmax / 6.5 per block (/ 6 with stochastic rounding); 4 + 32/block bits/value."""

    name = "fp4-e2m1"
    codec_id = 6
    qmax = 6.0
    q_nearest = 6.5
    fp16_shift = 9   # exponent bits into the fp16 exponent's low bits: E2M1 value * 2^-14
    fp16_exp = 14
    native_kind = 2

    def code_blocks(self, xb, xa, inv, noise):
        y = torch.mul(xb, inv, out=xa)
        # The level index is an odd piecewise-linear function of y (slopes 2, 1, 1/2):
        # idx = y + clamp(y, -2, 2) - softshrink(y, 4) / 2; rounding it picks the nearest level.
        idx = y.clamp(-2.0, 2.0).add_(y).add_(F.softshrink(y, 4.0), alpha=-0.5)
        if noise is not None:
            idx.add_(noise).sub_(0.5).clamp_(-7.25, 7.25)
        signed = _round_to_int(idx).to(torch.int8)
        return signed.abs().bitwise_or_((signed >> 7) & 8)  # sign-magnitude


@register
class FP4E3M0(_FP4):
    """4-bit float E3M0 (sign + 3-bit exponent): magnitudes {0, 2^-6 .. 2^0} x scale,
    scale = absmax per block, rounding to the nearest level (in linear space, which gives a
    lower mean squared error than rounding in log space; values below 0.75 * 2^-6 x scale
    become 0); 4 + 32/block bits/value."""

    name = "fp4-e3m0"
    codec_id = 7
    qmax = 1.0
    q_nearest = 1.0
    fp16_shift = 10  # 3 bits as the fp16 exponent: 2^(L-15) = E3M0 value * 2^-8
    fp16_exp = 8
    native_kind = 3

    def code_gain(self) -> float:
        return 1.0 if self.stochastic else 4.0 / 3.0  # see code_blocks

    def code_blocks(self, xb, xa, inv, noise):
        if noise is None:
            # z = 4/3 |y|: 2^k is the nearest level to |y| iff 0.75 * 2^k <= |y| < 1.5 * 2^k,
            # i.e. iff z's exponent is k. Clamping z at 2^-7 puts its biased exponent in
            # [120, 127], whose low 3 bits are the level L = k + 7 (0 = zero).
            z = xa.mul_(inv).clamp_(min=2.0 ** -7)
            level = (z.view(torch.int32) >> 23) & 7
        else:
            # adding uniform noise to the mantissa bits carries into the exponent with
            # probability equal to the position between 2^k and 2^(k+1): unbiased rounding
            a = xa.mul_(inv)
            bits = a.view(torch.int32) + (noise * (1 << 23)).to(torch.int32)
            level = ((bits >> 23) - 120).clamp_(0, 7)
            # below the smallest level 2^-6: 0 or 2^-6 with probability |y| / 2^-6
            level = torch.where(a < 2.0 ** -6, (noise < a * 64).to(torch.int32), level)
        return level.bitwise_or_(_signbit8(xb))
