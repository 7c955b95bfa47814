"""The 4-bit blockwise codecs: int4, fp4-e2m1, fp4-e3m0 and lloyd4.

Layout 2 (the header's second parameter is the group size, 256). The four codecs differ only
in the 8 magnitudes a nibble can take, in units of the block's scale:

    int4       0, 1, 2, 3, 4, 5, 6, 7                    (uniform)
    fp4-e2m1   0, 0.5, 1, 1.5, 2, 3, 4, 6                (OCP MXFP4 element)
    fp4-e3m0   0, 2^-6, 2^-5, ..., 2^-1, 1               (sign + 3-bit exponent)
    lloyd4     0 and 7 Lloyd-Max levels for Gaussian blocks under this block format (LLOYD4)

Payload: one fp32 *anchor* per group of 256 blocks (the group's absmax, at least 2^-80), one
8-bit *scale code* k per block, then the nibbles, two per byte (element 2i in the low nibble).
int4's nibbles are offset binary (nibble = q + 8 for q in [-7, 7]; nibble 0 is never written),
the others' sign-magnitude (bit 3 = sign, set only on a nonzero magnitude: nibble 8 is never
written; E2M1's magnitude bits are the OCP encoding). A block's scale is ``anchor * U[k]`` (fp32)
with ``U[k] = 2^(2 - k/8) / qn`` (a per-codec table of fp32 constants): scales step by 2^(1/8)
over 32 octaves, from 4 / qn times the group's absmax down. A value decodes to
``level * scale``. With blocks of 32 (the default) that is 4 + 8/32 + 32/8192 = 4.254 bits/value
(4.256 with the frame's header and checksum, in frames of 2^18 values). The frame header's p1
(256, the group size) marks this layout: builds that read the older one (p1 = 0, one fp32 scale
per block of 128) refuse these frames, and this one refuses theirs.

Encoding rounds each magnitude to the nearest level (ties: see the family rules in
``magnitude``) and picks each block's scale code by a *scale search*: among the codes next to
k0 -- the largest code whose scale maps the block's absmax to at most ``qn`` units, so that
clipping errs no more than rounding -- it takes the one whose decoded block is closest to the
input (least sum of squared errors, measured in fixed point so that every path and device makes
the same choice; the first on ties). ``search=False`` keeps k0. The search only changes which
scale code is written: decoding is one table lookup and one multiply per value whatever the
encoder did, and every member decodes the same bytes to the same bits (the quantize-once rule).
``stochastic=True`` (torch path; reproducible with ``seed``) uses k0 computed against the top
level (nothing clips) and rounds each magnitude up or down to its neighbouring levels with the
probabilities that make it unbiased; it errs about 1.5 times as much as nearest rounding.

A decoder refuses (FrameError) an anchor that is NaN, infinite, negative or below 2^-80, a scale
code whose block's top level would overflow to infinity (an anchor near float max with a small
code: the encoder never picks those), and the nibble the codec never writes.

On CPU, round-to-nearest encoding and decoding run in the optional C kernels of
``compress/_native.c`` (through ``blockwise``'s plumbing, so ``blockwise.USE_NATIVE`` and a
missing build apply here too), with the same bits as the torch code below, which stays the
reference and the path for other devices (and for stochastic rounding).
"""
from __future__ import annotations

import math

import torch

from ..codec import Codec, Parts
from ..errors import FrameError
from ..codec_table import register
from . import blockwise
from .blockwise import FLT_MAX, MAGIC, MAGIC_BITS, NativeCoded, _native_for, _native_out
from .common import (BlockSizeParam, check_block, check_scales, header_block, make_generator, n_blocks,
                     padded_blocks)
from .packing import pack_nibbles

#: blocks per fp32 anchor (the header's p1)
GROUP = 256
#: the smallest anchor: every scale (>= 2^-80 * U[255]) and nonzero level x scale stays a
#: normal float (>= 2^-116 for fp4-e3m0's 2^-6 level)
ANCHOR_FLOOR = 2.0 ** -80
#: scale codes step by 2^(1/STEPS) octaves
STEPS = 8
#: the search measures each value's error in 1/SEARCH_RES of the first candidate's scale
SEARCH_RES = 256.0
#: fp32(4/3): fp4-e3m0's level is the exponent of y * 4/3
GAIN43 = 1.33333337306976318359375
#: which rule of ``_native.encode4`` codes a family (the torch path mirrors each in ``magnitude``)
F_INT4, F_E2M1, F_E3M0, F_TABLE = 0, 1, 2, 3

#: Lloyd-Max magnitudes (in units; top level 7) for Gaussian data under this block format: blocks
#: of 32 with the scale search. Found by alternating the encoder (scale search, nearest level)
#: with the centroid update over 2^18 N(0, 1) values (``bench/codecs.py --design-lloyd4``).
LLOYD4 = (0.0, 0.719, 1.462, 2.253, 3.118, 4.111, 5.325, 7.0)


#: fp32 tables per (device, levels, qn, family), shared by every codec instance
_TABLES: dict[tuple, dict[str, torch.Tensor]] = {}


class Block4(BlockSizeParam, NativeCoded):
    """4-bit codes over blocks with 8-bit log scale codes and fp32 group anchors (see module)."""

    bits = 4
    default_block = 32
    supports_stochastic = True
    #: the 8 magnitudes (in units, ascending, the first 0)
    levels: tuple[float, ...]
    #: what k0 maps the block's absmax to (at most), in units
    qn: float
    #: scale codes tried around k0 by the search: k0 - lo .. k0 + hi
    window: tuple[int, int] = (1, 1)
    #: the family's rule from y = |x| / scale to the level index (F_*)
    family: int = F_TABLE

    def __init__(self, *, block_size: int | None = None, search: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.block_size = check_block("block_size", self.default_block if block_size is None
                                      else block_size, lo=2, multiple=2)
        if not isinstance(search, bool):
            raise ValueError(f"search must be a bool, got {search!r}")
        self.search = search

    @property
    def params(self) -> dict:
        return {"block_size": self.block_size, "search": self.search,
                **Codec.params.fget(self)}  # type: ignore[attr-defined]

    @property
    def header_params(self) -> tuple[int, int, int]:
        return (self.block_size, GROUP, 0)

    @classmethod
    def from_header(cls, p0: int, p1: int, p2: int) -> "Block4":
        header_block(cls.name, "block_size", p0, lo=2, multiple=2)
        if p1 != GROUP:
            raise FrameError(f"{cls.name} header has group size {p1}, this build reads {GROUP} "
                             "(0: the layout before scale codes, one fp32 scale per block)")
        if p2:
            raise FrameError(f"{cls.name} header has nonzero unused parameter {p2}")
        return cls(block_size=p0)

    def part_layout(self, count: int) -> list[tuple[torch.dtype, int]]:
        nb = n_blocks(count, self.block_size)
        return [(torch.float32, n_blocks(nb, GROUP)), (torch.uint8, nb),
                (torch.uint8, -(-count // 2))]

    # ---- tables (fp32, computed once per device and level set) ----
    def _tables(self, device: torch.device) -> dict:
        key = (device, self.levels, self.qn, self.family)
        t = _TABLES.get(key)
        if t is None:
            lev64 = torch.tensor(self.levels, dtype=torch.float64)
            lev = lev64.float()
            thr = ((lev64[1:] + lev64[:-1]) / 2).float()
            k = torch.arange(256, dtype=torch.float64)
            scale = (torch.exp2(2.0 - k / STEPS) / self.qn).float()
            if self.family == F_INT4:  # offset binary: nibble - 8 (0 -> -8, never written)
                signed = torch.arange(16, dtype=torch.float32) - 8
            else:  # sign-magnitude (8 -> -0.0, never written)
                signed = torch.cat([lev, -lev])
            pair = torch.stack([signed.repeat(16), signed.repeat_interleave(16)], 1)  # byte -> lo, hi
            t = {"lev": lev, "thr": thr, "U": scale, "table": signed,
                 "pairs": pair.contiguous().view(torch.int64).reshape(256),
                 "levthr": torch.cat([thr, lev]).contiguous(),
                 "qn": torch.tensor(self.qn, dtype=torch.float32),
                 "top": torch.tensor(self.levels[-1], dtype=torch.float32)}
            t = _TABLES.setdefault(key, {name: v.to(device) for name, v in t.items()})
        return t

    # ---- encode ----
    def quantize(self, x: torch.Tensor) -> Parts:
        n = x.numel()
        if n == 0:
            return [x.new_empty(0), x.new_empty(0, dtype=torch.uint8),
                    x.new_empty(0, dtype=torch.uint8)]
        if self._native_codes(x):
            return self._native_parts(x)
        return self._quantize_torch(x)

    def _encode_native(self, x: torch.Tensor, parts: Parts) -> None:
        """``quantize`` by the C kernel into ``parts`` (anchors, scale codes, packed codes):
        the same bits as the torch path."""
        x = x.contiguous()
        anchors, scodes, codes = parts
        t = self._tables(x.device)
        lo, hi = self.window if self.search else (0, 0)
        bad = blockwise._native.encode4(self.family, x.data_ptr(), x.numel(), self.block_size, GROUP,
                              t["levthr"].data_ptr(), t["U"].data_ptr(), self.qn, lo, hi,
                              ANCHOR_FLOOR, anchors.data_ptr(), scodes.data_ptr(), codes.data_ptr())
        if bad:
            raise ValueError(f"{self.name} cannot encode NaN or infinite values")

    def _quantize_torch(self, x: torch.Tensor) -> Parts:
        """The reference: the same fp32 operations as the C kernel, vectorized over blocks."""
        n, dev = x.numel(), x.device
        t = self._tables(dev)
        U, thr, lev = t["U"], t["thr"], t["lev"]
        xb = padded_blocks(x, self.block_size)
        a = xb.abs()
        am = a.amax(dim=1)
        nb = am.numel()
        if not math.isfinite(am.max()):
            raise ValueError(f"{self.name} cannot encode NaN or infinite values")
        ng = n_blocks(nb, GROUP)
        grouped = am.new_zeros(ng * GROUP)
        grouped[:nb] = am
        anchors = grouped.view(ng, GROUP).amax(dim=1).clamp_(min=ANCHOR_FLOOR)
        A = anchors.repeat_interleave(GROUP)[:nb]

        def scale(k: torch.Tensor) -> torch.Tensor:
            return A * U[k]

        # the smallest code whose top level stays finite (0 unless an anchor is near float max)
        kmin = torch.zeros(nb, dtype=torch.int64, device=dev)
        if not bool(torch.isfinite(scale(kmin) * t["top"]).all()):
            kmin.fill_(255)
            for step in (128, 64, 32, 16, 8, 4, 2, 1):
                kk = kmin - step
                ok = (kk >= 0) & torch.isfinite(scale(kk.clamp(min=0)) * t["top"])
                kmin = torch.where(ok, kk, kmin)
        # k0: the largest code whose scale maps the absmax to at most qn (top with stochastic)
        reach = t["top"] if self.stochastic else t["qn"]
        k0 = torch.zeros(nb, dtype=torch.int64, device=dev)
        for step in (128, 64, 32, 16, 8, 4, 2, 1):
            kk = k0 + step
            ok = (kk <= 255) & (am <= scale(kk.clamp(max=255)) * reach)
            k0 = torch.where(ok, kk, k0)
        if self.stochastic:
            best = torch.maximum(k0, kmin)
            inv = torch.reciprocal(scale(best))[:, None]
            y = a * inv  # in units; nothing above the top level
            idx = torch.bucketize(y, lev[1:], right=True)  # lev[idx] <= y < lev[idx + 1]
            lower, upper = lev[idx], lev[(idx + 1).clamp(max=7)]
            gap = torch.where(upper > lower, upper - lower, torch.ones_like(upper))
            noise = torch.rand(xb.shape, device=dev, generator=make_generator(self.seed, dev))
            m = idx + (noise * gap < y - lower).to(idx.dtype)
            m = m.clamp_(max=7)
        else:
            lo, hi = self.window if self.search else (0, 0)
            klo = torch.maximum(k0 - lo, kmin)
            khi = (k0 + hi).clamp(max=255)
            clash = klo > khi  # only with hi = 0 next to float max
            klo = torch.where(clash, kmin, klo)
            khi = torch.where(clash, kmin, khi)
            best = klo
            if lo or hi:
                s = torch.reciprocal(scale(klo)) * SEARCH_RES
                best_err = None
                for j in range(-lo, hi + 1):
                    k = k0 + j
                    valid = (k >= klo) & (k <= khi)
                    k = torch.where(valid, k, klo)
                    u = scale(k)
                    y = a * torch.reciprocal(u)[:, None]
                    d = (y - lev[self.magnitude(y, thr)]) * (u * s)[:, None]
                    di = (d + MAGIC).view(torch.int32) - MAGIC_BITS
                    err = di.to(torch.int64).square().sum(dim=1)
                    if best_err is None:
                        best_err = err  # j = -lo: k = klo, always valid
                        continue
                    better = valid & (err < best_err)
                    best_err = torch.where(better, err, best_err)
                    best = torch.where(better, k, best)
            inv = torch.reciprocal(scale(best))[:, None]
            if self.family == F_INT4:  # offset binary straight from the signed value
                y = (xb * inv).clamp_(-7.0, 7.0).add_(MAGIC + 8.0)
                nib = (y.view(torch.int32) & 0xFF).reshape(-1)[:n]
                return [anchors, best.to(torch.uint8), pack_nibbles(nib.to(torch.uint8), False)]
            m = self.magnitude(a * inv, thr)
        neg = xb < 0
        if self.family == F_INT4:
            nib = torch.where(neg, 8 - m, 8 + m)
        else:
            nib = m | ((neg & (m > 0)).to(m.dtype) << 3)
        return [anchors, best.to(torch.uint8), pack_nibbles(nib.reshape(-1)[:n].to(torch.uint8), False)]

    def magnitude(self, y: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
        """Level indices (int64, 0..7) of magnitudes ``y`` in units: the C kernel's rule for this
        family, the same fp32 operations (``thr``: the 7 thresholds, for F_TABLE)."""
        if self.family == F_INT4:  # nearest, ties to even
            return (y.clamp(max=7.0) + MAGIC).view(torch.int32).sub(MAGIC_BITS).long()
        if self.family == F_E2M1:
            # round to the E2M1 grid as a float with 1 mantissa bit and steps no finer than 1/2:
            # add and subtract c = 2^22 * max(2^exponent(z), 1) (ties even); index from the bits
            z = y.clamp(max=6.0)
            c = (z.view(torch.int32) & 0x7F800000).clamp_(min=0x3F800000).add_(22 << 23)
            c = c.view(torch.float32)
            v = (z + c) - c
            hi = (v.view(torch.int32) >> 22) - 252
            return torch.where(v < 1.0, (v > 0.0).to(hi.dtype), hi).long()
        if self.family == F_E3M0:
            # 2^k is the nearest level to y iff 0.75 * 2^k <= y < 1.5 * 2^k, i.e. iff the exponent
            # of 4/3 y is k; clamped to [2^-7, 1.5] the low 3 bits of its biased exponent are the
            # level (0: zero, below 0.75 * 2^-6)
            z = (y * GAIN43).clamp_(min=2.0 ** -7, max=1.5)
            return ((z.view(torch.int32) >> 23) & 7).long()
        return torch.bucketize(y, thr, right=True)  # nearest, ties up

    # ---- decode ----
    def validate(self, parts: Parts, count: int) -> None:
        anchors, scodes, codes = parts
        check_scales(self.name, anchors)
        if not anchors.numel():
            return
        lo, hi = (float(v) for v in torch.aminmax(anchors))
        if lo < ANCHOR_FLOOR:
            raise FrameError(f"{self.name} frame has an anchor scale of {lo:g}, below the smallest its encoder "
                             f"writes (2^-80): a zero or tiny scale would decode its blocks' codes to 0 "
                             "instead of their values")
        t = self._tables(torch.device("cpu"))
        if hi * float(t["U"][0]) * self.levels[-1] * (1 + 2.0 ** -20) >= FLT_MAX:
            # an anchor near float max: a small scale code would overflow; the encoder never
            # writes one (the usual case skips this check)
            dev = scodes.device
            td = self._tables(dev)
            A = anchors.repeat_interleave(GROUP)[:scodes.numel()]
            if not bool(torch.isfinite(A * td["U"][scodes.long()] * td["top"]).all()):
                raise FrameError(f"{self.name} frame has a scale code its encoder never writes: its block's "
                                 "top level would overflow to infinity")
        nib = 0 if self.family == F_INT4 else 8
        whole = count // 2  # bytes with two codes; an odd count's last high nibble is padding
        if _native_for(codes):
            bad = blockwise._native.has_nibble(codes.contiguous().data_ptr(), whole, nib)
        else:
            pairs = codes[:whole]
            bad = bool((((pairs & 0x0F) == nib) | ((pairs & 0xF0) == nib << 4)).any())
        if count % 2:
            bad = bad or int(codes[whole]) & 0x0F == nib
        if bad:
            what = "-8" if nib == 0 else "minus zero"
            raise FrameError(f"{self.name} frame has a code its encoder never writes (nibble {nib}, {what})")

    def dequantize(self, parts: Parts, count: int) -> torch.Tensor:
        anchors, scodes, codes = parts
        if count == 0:
            return torch.empty(0, device=codes.device)
        if _native_for(codes):
            return self._dequantize_native(parts, count)
        t = self._tables(codes.device)
        nb, b = scodes.numel(), self.block_size
        vs = anchors.repeat_interleave(GROUP)[:nb] * t["U"][scodes.long()]
        values = t["pairs"].index_select(0, codes.to(torch.int32)).view(torch.float32)
        if values.numel() != nb * b:
            padded = values.new_zeros(nb * b)
            padded[:count] = values[:count]
            values = padded
        out = values.view(nb, b).mul_(vs[:, None]).view(-1)
        return out[:count].clone() if nb * b != count else out

    def dequantize_into(self, parts: Parts, count: int, out: torch.Tensor) -> torch.Tensor:
        if count and _native_for(parts[2]) and _native_out(out, count):
            return self._dequantize_native(parts, count, out)
        return out.copy_(self.dequantize(parts, count))

    def _dequantize_native(self, parts: Parts, count: int,
                           out: torch.Tensor | None = None) -> torch.Tensor:
        anchors, scodes, codes = parts
        nb = n_blocks(count, self.block_size)
        if (anchors.numel() != n_blocks(nb, GROUP) or scodes.numel() != nb
                or codes.numel() != -(-count // 2) or anchors.dtype != torch.float32
                or scodes.dtype != torch.uint8 or codes.dtype != torch.uint8):
            raise AssertionError("4-bit parts do not match the part layout")
        t = self._tables(torch.device("cpu"))
        anchors, scodes, codes = anchors.contiguous(), scodes.contiguous(), codes.contiguous()
        if out is None:
            out = torch.empty(count)
        blockwise._native.decode4s(codes.data_ptr(), count, self.block_size, GROUP, t["table"].data_ptr(),
                         anchors.data_ptr(), scodes.data_ptr(), t["U"].data_ptr(), out.data_ptr())
        return out


@register
class Int4(Block4):
    """Uniform 4-bit: magnitudes 0..7 x the block scale (offset-binary nibbles); blocks of 32
    with 8-bit log scale codes and the scale search (4.254 bits/value)."""

    name = "int4"
    codec_id = 5
    levels = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)
    qn = 7.49
    family = F_INT4


@register
class FP4E2M1(Block4):
    """4-bit float E2M1 (OCP MXFP4 element): magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} x the block
    scale; blocks of 32 with 8-bit log scale codes and the scale search (4.254 bits/value)."""

    name = "fp4-e2m1"
    codec_id = 6
    levels = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    qn = 6.5
    family = F_E2M1


@register
class FP4E3M0(Block4):
    """4-bit float E3M0 (sign + 3-bit exponent): magnitudes {0, 2^-6 .. 2^0} x the block scale;
    blocks of 32 with 8-bit log scale codes and the scale search over a whole octave of scales
    (its levels are an octave apart), 4.254 bits/value."""

    name = "fp4-e3m0"
    codec_id = 7
    levels = (0.0,) + tuple(2.0 ** -k for k in range(6, -1, -1))
    qn = 1.0
    window = (3, 4)
    family = F_E3M0


@register
class Lloyd4(Block4):
    """Non-uniform 4-bit: 0 and 7 magnitudes placed by Lloyd-Max for Gaussian blocks under this
    format (``LLOYD4``), denser near 0 than int4; blocks of 32 with 8-bit log scale codes and
    the scale search (4.254 bits/value)."""

    name = "lloyd4"
    codec_id = 10
    levels = LLOYD4
    qn = 7.49
