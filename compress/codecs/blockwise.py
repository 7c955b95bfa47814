"""Blockwise scaled codecs: int8, and the C kernels' plumbing shared with the 4-bit codecs.

**int8**: each block of ``block_size`` values (default 256) gets one fp32 absmax scale; payload:
the fp32 scales, then one int8 code per value in [-127, 127] (8 + 32/256 = 8.125 bits/value).
Scales are never below 2^-100 / 127, so they stay normal floats; a decoder refuses (FrameError)
a scale that is zero or below that floor, above the largest the encoder can write (float32 max
/ 127), NaN, infinite or negative -- none can come from an encoder, and a zero scale would
silently turn any codes into zeros -- and, where a scale is so large that the code -128 (never
written) would overflow, that code.

The 4-bit codecs (int4, fp4-e2m1, fp4-e3m0, lloyd4) are in ``block4.py``; both families share
the C kernels' plumbing here (``NativeCoded``, ``USE_NATIVE``).

On CPU, round-to-nearest encoding and decoding run in the optional C kernels of
``compress/_native.c`` when they are built (``pip install -e .``), with the same bits as the
torch code, which stays the reference and the path for other devices (and for stochastic
rounding).
"""
from __future__ import annotations

import math
import os
import warnings

import torch

from ..codec import Codec, Parts
from ..errors import FrameError
from ..codec_table import register
from .common import (BlockSizeParam, check_block, check_scales, header_block, make_generator, n_blocks,
                     padded_blocks)

TINY = 2.0 ** -100
FLT_MAX = float(torch.finfo(torch.float32).max)
#: Adding 1.5 * 2^23 to a float of magnitude < 2^22 rounds it to an integer (half to even) that
#: then sits in the low bits of the sum's int32 view.
MAGIC = 12582912.0
MAGIC_BITS = 0x4B400000

#: the kernels of _native.c (these codecs', compress.fingerprint's and compress.entropy's): a build older than the
#: source lacks some, and is not used
NATIVE_KERNELS = ("encode", "decode8", "encode4", "decode4s", "has_nibble", "fingerprint32", "shuffle", "unshuffle")

try:
    from .. import _native
except ImportError:  # not built: the torch path does everything
    _native = None
if _native is not None and not all(hasattr(_native, k) for k in NATIVE_KERNELS):
    warnings.warn(f"compress._native ({_native.__file__}) is older than its source and lacks "
                  f"{[k for k in NATIVE_KERNELS if not hasattr(_native, k)]}: using the torch path "
                  "(same bits, slower); rebuild it with `pip install -e .`", RuntimeWarning, stacklevel=1)
    _native = None

#: False forces the torch path on CPU as well (tests compare the two); the environment variable
#: COMPRESS_NATIVE=0 sets it at import.
USE_NATIVE = os.environ.get("COMPRESS_NATIVE", "1") != "0"


def native_available() -> bool:
    """Whether the C kernels were built and are enabled."""
    return _native is not None and USE_NATIVE


def _native_for(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and native_available()


def _native_out(out: torch.Tensor, count: int) -> bool:
    """Whether a C kernel may write ``count`` fp32 values through ``out``'s data pointer."""
    return (out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
            and out.numel() == count)


class NativeCoded(Codec):
    """A codec whose C kernel writes the parts of a round-to-nearest encode wherever it is told
    (``_encode_native``): into new tensors for ``quantize``, straight into the frame for
    ``quantize_into``."""

    def _encode_native(self, x: torch.Tensor, parts: Parts) -> None:
        raise NotImplementedError

    def _native_codes(self, x: torch.Tensor) -> bool:
        """Whether the C kernel codes x (round to nearest, a CPU fp32 tensor, kernels built)."""
        return not self.stochastic and _native_for(x) and x.dtype == torch.float32

    def _native_parts(self, x: torch.Tensor) -> Parts:
        parts = [torch.empty(n, dtype=dt) for dt, n in self.part_layout(x.numel())]
        self._encode_native(x, parts)
        return parts

    def quantize_into(self, x: torch.Tensor, parts: Parts) -> bool:
        if not x.numel() or not self._native_codes(x):
            return False
        self._encode_native(x, parts)
        return True


class BlockScaled(BlockSizeParam, NativeCoded):
    """int8 machinery: fp32 absmax scale per block, one code per value, optional stochastic
    rounding."""

    default_block: int = 256
    #: the largest code magnitude (what the absmax maps to with stochastic rounding)
    qmax: float = 127.0
    #: what the block's absmax maps to with round-to-nearest
    q_nearest: float = 127.0

    supports_stochastic = True
    #: which kernel of ``_native.encode`` codes this family (None: torch only), and the constant
    #: it adds after scaling (MAGIC + offset)
    native_kind: int | None = None
    native_add: float = 0.0

    def __init__(self, *, block_size: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.block_size = check_block("block_size", self.default_block if block_size is None
                                      else block_size)

    @classmethod
    def from_header(cls, p0: int, p1: int, p2: int) -> "BlockScaled":
        header_block(cls.name, "block_size", p0)
        if p1 or p2:
            raise FrameError(f"{cls.name} header has nonzero unused parameters {(p1, p2)}")
        return cls(block_size=p0)

    def part_layout(self, count: int) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, n_blocks(count, self.block_size)), (torch.int8, count)]

    def quantize(self, x: torch.Tensor) -> Parts:
        n = x.numel()
        if n == 0:
            return [x.new_empty(0), x.new_empty(0, dtype=torch.int8)]
        if self._native_codes(x):
            return self._native_parts(x)
        xb = padded_blocks(x, self.block_size)
        xa = xb.abs()
        absmax = xa.amax(dim=1)
        if not math.isfinite(absmax.max()):
            raise ValueError(f"{self.name} cannot encode NaN or infinite values")
        q = self.qmax if self.stochastic else self.q_nearest
        # the floor keeps scales normal floats; zero blocks still code as 0. A tensor divisor: CUDA
        # turns a division by a number into a product with its reciprocal, which rounds differently
        # from the C kernel's division (and a CPU and a GPU member must write the same frame)
        scale = absmax.clamp_(min=TINY).div_(torch.full_like(absmax, q))
        inv = torch.reciprocal(scale)[:, None]
        noise = None
        if self.stochastic:
            noise = torch.rand(xb.shape, device=x.device,
                               generator=make_generator(self.seed, x.device))
        codes = self.code_blocks(xb, xa, inv, noise).reshape(-1)[:n]
        return [scale, codes]

    def _native_codes(self, x: torch.Tensor) -> bool:
        return self.native_kind is not None and super()._native_codes(x)

    def _encode_native(self, x: torch.Tensor, parts: Parts) -> None:
        """``quantize`` (round to nearest) by the C kernel, into ``parts`` (scales and codes of
        ``part_layout``'s dtypes): the same scales and codes as the torch path."""
        x = x.contiguous()  # (the pointers below must outlive the call: keep the tensors)
        scale, codes = parts
        bad = _native.encode(self.native_kind, x.data_ptr(), x.numel(), self.block_size,
                             self.q_nearest, 1.0, self.native_add, scale.data_ptr(),
                             codes.data_ptr())
        if bad:
            raise ValueError(f"{self.name} cannot encode NaN or infinite values")

    def dequantize(self, parts: Parts, count: int) -> torch.Tensor:
        scale, codes = parts
        if count == 0:
            return torch.empty(0, device=scale.device)
        if self.native_kind is not None and _native_for(codes):
            return self.dequantize_into(parts, count, torch.empty(count))
        values = self.values(codes, count)
        nb, b = scale.numel(), self.block_size
        if nb * b != count:
            padded = values.new_zeros(nb * b)
            padded[:count] = values
            values = padded
        out = values.view(nb, b).mul_(scale[:, None]).view(-1)
        return out[:count] if nb * b != count else out

    def dequantize_into(self, parts: Parts, count: int, out: torch.Tensor) -> torch.Tensor:
        scale, codes = parts
        if count and self.native_kind is not None and _native_for(codes) and _native_out(out, count):
            # the kernel's values are the codes as floats (int8's), times their block's scale
            if (scale.numel() != n_blocks(count, self.block_size) or codes.numel() != count
                    or scale.dtype != torch.float32 or codes.dtype != torch.int8):
                raise AssertionError("int8 parts do not match the part layout")
            scale, codes = scale.contiguous(), codes.contiguous()
            _native.decode8(codes.data_ptr(), count, self.block_size, scale.data_ptr(),
                            out.data_ptr())
            return out
        return out.copy_(self.dequantize(parts, count))

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
        """A new fp32 tensor: ``count`` payload codes in units of the block scale."""
        raise NotImplementedError


def _round_to_int(y: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """round(y) + offset in the low byte of an int32 tensor (|y + offset| <= 127), consuming y;
    converting it to int8 keeps exactly that byte."""
    return y.add_(MAGIC + offset).view(torch.int32)


class _IntBlock(BlockScaled):
    offset: float = 0.0
    #: the code the encoder never writes (int8 -128) and its magnitude
    unused_code: int = -128
    unused_magnitude: float = 128.0

    def validate_codes(self, parts: Parts, count: int, max_scale: float) -> None:
        if max_scale * self.unused_magnitude <= FLT_MAX:
            return  # no code can overflow: nothing to check (the usual case, at no cost)
        if bool((parts[1] == self.unused_code).any()):
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
    qmax = 127.0
    q_nearest = 127.0
    native_kind = 0
    native_add = MAGIC

    def values(self, codes, count):
        return codes.to(torch.float32)
