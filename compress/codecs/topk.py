"""topk: per chunk, the k largest-magnitude values, with low-bit values and coded indices
(as in SparseLoCo: k=64 of every 4096, 2-bit values).

Biased on its own; use it through ErrorFeedback. For each chunk, the kept magnitudes are coded
on ``2^(value_bits-1)`` evenly spaced levels between the chunk's smallest and largest kept
magnitude, plus a sign bit. Payload, in this order: per chunk fp32 ``lo`` and fp32 ``step``;
then the level+sign fields (``value_bits`` each); then the in-chunk indices, ascending within
every chunk, either Elias-Fano coded (``indices="elias-fano"``, the default: 8.0 bits per index
at k=64 of 4096, ``elias_fano``) as their low fields then their bitmaps, or as plain
``ceil(log2 chunk)``-bit fields (``indices="fixed"``: 12 bits). A short last chunk keeps
``min(k, its length)`` values. The header's third parameter holds ``value_bits``, plus 256 for
Elias-Fano indices, 512 for ``mean="senders"`` and 1024 for ``clip_median``.

``mean`` and ``clip_median`` say how the gather averages the groups' decoded contributions
(``compress.gather_rule``: over all groups, or each index over the groups that sent it as the
SparseLoCo authors' code does; clipped to the median norm first). Every group must average the
same way or their global states part, so the frame carries both and a decoder whose own differ
refuses it (``Codec.decode``): a group started with another ``--topk-mean`` is named at its
first exchange, not found later by the state hash.
"""
from __future__ import annotations

import torch

from ..codec import Codec, Parts
from ..errors import FrameError
from ..finite import all_finite
from ..gather_rule import MEAN_ALL, MEAN_SENDERS, check_mean
from ..codec_table import register
from . import elias_fano
from .common import check_block, header_block, n_blocks
from .packing import pack_fields, packed_bytes, unpack_fields

MAX_CHUNK = 1 << 16
INDEX_CODINGS = ("elias-fano", "fixed")
# in the header's third parameter, above value_bits
ELIAS_FANO_FLAG = 256
MEAN_SENDERS_FLAG = 512
CLIP_MEDIAN_FLAG = 1024


def _index_bits(chunk: int) -> int:
    return max(1, (chunk - 1).bit_length())


@register
class TopK(Codec):
    """Chunked top-k sparsification: about k*(value_bits + log2 chunk)/chunk bits/value."""

    name = "topk"
    codec_id = 9
    requires_error_feedback = True

    def __init__(self, *, chunk: int = 4096, k: int | None = None, density: float | None = None,
                 value_bits: int = 2, indices: str = "elias-fano", mean: str = MEAN_ALL, clip_median: bool = False,
                 **kw) -> None:
        super().__init__(**kw)
        problem = check_mean(mean)
        if problem:
            raise ValueError(f"mean {problem}")
        if not isinstance(clip_median, bool):
            raise ValueError(f"clip_median must be a bool, got {clip_median!r}")
        self.mean, self.clip_median = mean, clip_median
        if indices not in INDEX_CODINGS:
            raise ValueError(f"indices must be one of {', '.join(INDEX_CODINGS)}, got {indices!r}")
        self.indices = indices
        self.chunk = check_block("chunk", chunk, hi=MAX_CHUNK)
        if k is not None and density is not None:
            raise ValueError("give topk either k or density, not both")
        if density is not None:
            if not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
                raise ValueError(f"density must be in (0, 1], got {density!r}")
            k = max(1, round(density * self.chunk))
        self.k = check_block("k", 64 if k is None else k, hi=self.chunk)
        self.value_bits = check_block("value_bits", value_bits, hi=8)

    @property
    def params(self) -> dict:
        return {"chunk": self.chunk, "k": self.k, "value_bits": self.value_bits, "indices": self.indices,
                "mean": self.mean, "clip_median": self.clip_median, **super().params}

    @property
    def header_params(self) -> tuple[int, int, int]:
        flags = ((ELIAS_FANO_FLAG if self.indices == "elias-fano" else 0)
                 | (MEAN_SENDERS_FLAG if self.mean == MEAN_SENDERS else 0) | (CLIP_MEDIAN_FLAG if self.clip_median else 0))
        return (self.chunk, self.k, self.value_bits | flags)

    @classmethod
    def from_header(cls, p0: int, p1: int, p2: int) -> "TopK":
        header_block(cls.name, "chunk", p0, hi=MAX_CHUNK)
        header_block(cls.name, "k", p1, hi=p0)
        if p2 & ~(ELIAS_FANO_FLAG | MEAN_SENDERS_FLAG | CLIP_MEDIAN_FLAG | (ELIAS_FANO_FLAG - 1)):
            raise FrameError(f"{cls.name} frame header's third parameter {p2} has unknown flag bits")
        header_block(cls.name, "value_bits", p2 % ELIAS_FANO_FLAG, hi=8)
        return cls(chunk=p0, k=p1, value_bits=p2 % ELIAS_FANO_FLAG,
                   indices="elias-fano" if p2 & ELIAS_FANO_FLAG else "fixed",
                   mean=MEAN_SENDERS if p2 & MEAN_SENDERS_FLAG else MEAN_ALL, clip_median=bool(p2 & CLIP_MEDIAN_FLAG))

    def kept(self, count: int) -> int:
        """Number of values kept from ``count`` inputs."""
        nc = n_blocks(count, self.chunk)
        if nc == 0:
            return 0
        return (nc - 1) * self.k + min(self.k, count - (nc - 1) * self.chunk)

    def _chunks(self, count: int) -> list[tuple[int, int, int]]:
        """``(chunks, values, kept)``: the full chunks, then a short last one if there is one."""
        full, rest = divmod(count, self.chunk)
        return [(full, self.chunk, self.k)] * bool(full) + [(1, rest, min(self.k, rest))] * bool(rest)

    def part_layout(self, count: int) -> list[tuple[torch.dtype, int]]:
        nc, m = n_blocks(count, self.chunk), self.kept(count)
        layout = [(torch.float32, 2 * nc), (torch.uint8, packed_bytes(m, self.value_bits))]
        if self.indices == "fixed":
            return layout + [(torch.uint8, packed_bytes(m, _index_bits(self.chunk)))]
        for chunks, n, k in self._chunks(count):
            layout += [(torch.uint8, packed_bytes(chunks * k, elias_fano.low_bits(n, k))),
                       (torch.uint8, packed_bytes(chunks * elias_fano.bitmap_bits(n, k), 1))]
        return layout

    def quantize(self, x: torch.Tensor) -> Parts:
        n, c, k = x.numel(), self.chunk, self.k
        if n == 0:  # no chunk: no lo/step, no fields, and fixed indices' empty part (none for Elias-Fano)
            e = x.new_empty(0, dtype=torch.uint8)
            return [x.new_empty(0), e] + [e] * (self.indices == "fixed")
        if not all_finite(x):
            raise ValueError("topk cannot encode NaN or infinite values")
        nc = n_blocks(n, c)
        mag = torch.full((nc * c,), -1.0, device=x.device)  # padding never beats a real value
        mag[:n] = x.abs()
        mag = mag.view(nc, c)
        k = min(k, c)
        idx = mag.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        m_abs = mag.gather(1, idx)
        hi = m_abs.amax(dim=1)
        lo = m_abs.masked_fill(m_abs < 0, float("inf")).amin(dim=1)
        levels = 1 << (self.value_bits - 1)
        if levels == 1:  # one magnitude per chunk: the mean kept magnitude
            real = (m_abs >= 0).sum(dim=1)
            lo = m_abs.clamp(min=0).sum(dim=1) / real
            step = torch.zeros_like(lo)
            j = torch.zeros_like(idx, dtype=torch.int32)
        else:
            step = (hi - lo) / (levels - 1)
            safe = torch.where(step > 0, step, torch.ones_like(step))
            j = ((m_abs - lo[:, None]) / safe[:, None]).round_().clamp_(0, levels - 1)
            j = j.to(torch.int32)
        xp = x if nc * c == n else torch.cat([x, x.new_zeros(nc * c - n)])
        neg = xp.view(nc, c).gather(1, idx) < 0
        fields = (j << 1) | neg.to(torch.int32)  # sign in bit 0
        keep = self.kept(n)
        parts = [torch.stack([lo, step], dim=1).reshape(-1), pack_fields(fields.reshape(-1)[:keep], self.value_bits)]
        if self.indices == "fixed":
            return parts + [pack_fields(idx.reshape(-1)[:keep], _index_bits(c))]
        done = 0
        for chunks, values, kept in self._chunks(n):
            parts += elias_fano.encode(idx[done:done + chunks, :kept].to(torch.int64), values)
            done += chunks
        return parts

    def _unpack(self, parts: Parts, count: int) -> tuple[torch.Tensor, ...]:
        meta, vbytes, *ibytes = parts
        m = self.kept(count)
        fields = unpack_fields(vbytes, m, self.value_bits)
        if self.indices == "fixed":
            idx = unpack_fields(ibytes[0], m, _index_bits(self.chunk)).to(torch.int64)
        else:
            rows = [elias_fano.decode(low, bitmap, chunks, kept, values).reshape(-1)
                    for (chunks, values, kept), low, bitmap in zip(self._chunks(count), ibytes[0::2], ibytes[1::2])]
            idx = torch.cat(rows) if rows else fields.new_empty(0, dtype=torch.int64)
        chunk_of = torch.arange(m, device=idx.device, dtype=torch.int64) // self.k
        flat = chunk_of * self.chunk + idx
        return meta.view(-1, 2), fields, idx, chunk_of, flat

    def validate(self, parts: Parts, count: int) -> None:
        meta, fields, idx, _, flat = self._unpack(parts, count)
        if meta.numel() and not bool(torch.isfinite(meta).all() and (meta >= 0).all()):
            raise FrameError("topk frame has a NaN, infinite or negative value scale")
        if idx.numel() == 0:
            return
        if bool((idx >= self.chunk).any()) or int(flat[-1]) >= count:
            raise FrameError("topk frame has an index outside its chunk")
        if not bool((flat[1:] > flat[:-1]).all()):
            raise FrameError("topk frame has indices that are not strictly ascending in a chunk")

    def _kept(self, parts: Parts, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in the vector, values) of the kept entries, on the parts' device."""
        meta, fields, _, chunk_of, flat = self._unpack(parts, count)
        lo, step = meta[chunk_of, 0], meta[chunk_of, 1]
        mag = (fields >> 1).to(torch.float32).mul_(step).add_(lo)
        return flat, torch.where((fields & 1).bool(), -mag, mag)

    def dequantize(self, parts: Parts, count: int) -> torch.Tensor:
        flat, val = self._kept(parts, count)
        out = torch.zeros(count, device=parts[0].device)
        out[flat] = val
        return out

    def dequantize_on(self, parts: Parts, count: int, device: torch.device | str | None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """The indices are unpacked on the host and only the kept entries go to the device: the
        Elias-Fano scan is many small steps, each a kernel launch and a sync on a GPU (decoding
        there ran at 0.1 GB/s of output on an H200, bench/results/codecs_cuda.json)."""
        if device is None or torch.device(device).type == "cpu":
            return super().dequantize_on(parts, count, device, out)
        flat, val = self._kept(parts, count)
        target = torch.zeros(count, device=device) if out is None else out.zero_()
        target[flat.to(target.device)] = val.to(target.device)
        return target
