"""The codec base class: framing, entropy stage and the quantize-once path.

A subclass only says how a 1-D fp32 tensor becomes a list of *parts* (tensors laid end to end in
the payload) and back. The base class does the rest, so every codec gets the same frame, checks,
zstd option and the guarantee ``encode_with_decoded(x)[1] == decode(encode(x))`` bit for bit.
"""
from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from typing import ClassVar, Sequence

import torch

from . import entropy, frame
from .codec_table import codec_name
from .errors import FrameError
from .gather_rule import MEAN_ALL, MEAN_SENDERS

Parts = list[torch.Tensor]
#: what ``encode`` returns: a bytes-like frame (a bytearray; a memoryview of page-locked memory
#: for CUDA input without zstd)
Frame = bytearray | memoryview


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


class Codec(ABC):
    """Turns a 1-D float32 tensor into one self-describing frame (bytes) and back.

    Stateless and thread-safe. ``zstd=True`` adds the entropy stage (level ``zstd_level``).
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    #: Whether the codec is biased enough that it should only be used through ErrorFeedback.
    requires_error_feedback: ClassVar[bool] = False
    #: Word size in bytes that the byte-shuffle uses before zstd (1 = no shuffle).
    shuffle_width: ClassVar[int] = 1
    #: Whether ``stochastic=True`` (unbiased random rounding instead of nearest) is offered.
    supports_stochastic: ClassVar[bool] = False
    #: How an all-gather of this codec's frames averages the groups' decoded contributions
    #: (``compress.gather_rule``, read by ``transport.gather``): over all groups unless a codec's
    #: constructor says otherwise (``topk``: ``mean``, ``clip_median``).
    mean: str = MEAN_ALL
    clip_median: bool = False

    def __init__(self, *, zstd: bool = False, zstd_level: int = 1, stochastic: bool = False,
                 seed: int | None = None) -> None:
        if not isinstance(zstd, bool):
            raise ValueError(f"zstd must be a bool, got {zstd!r}")
        self.zstd = zstd
        self.zstd_level = _check_int("zstd_level", zstd_level, -7, 22)
        if not isinstance(stochastic, bool):
            raise ValueError(f"stochastic must be a bool, got {stochastic!r}")
        if stochastic and not self.supports_stochastic:
            raise ValueError(f"{self.name} has no stochastic rounding")
        self.stochastic = stochastic
        if seed is not None:
            _check_int("seed", seed, 0, 2**63 - 1)
        self.seed = seed  # None: torch's global RNG; an int: the same noise on every call

    # ---- what a subclass provides -------------------------------------------------------------
    @property
    def header_params(self) -> tuple[int, int, int]:
        """(p0, p1, p2) written to the header; they must fully describe the payload layout."""
        return (0, 0, 0)

    @classmethod
    def from_header(cls, p0: int, p1: int, p2: int) -> "Codec":
        """Build the codec a header describes; FrameError for parameters out of range."""
        if (p0, p1, p2) != (0, 0, 0):
            raise FrameError(f"{cls.name} frame has nonzero parameters {(p0, p1, p2)}")
        return cls()

    @abstractmethod
    def part_layout(self, count: int) -> list[tuple[torch.dtype, int]]:
        """(dtype, number of elements) of each payload part for ``count`` input values."""

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> Parts:
        """Parts for a contiguous 1-D fp32 tensor, on its device, with the element counts of
        ``part_layout``; a part may have another dtype if converting it to the layout's dtype
        (``Tensor.copy_``) gives the intended values (e.g. int32 codes for an int8 part)."""

    @abstractmethod
    def dequantize(self, parts: Parts, count: int) -> torch.Tensor:
        """A new fp32 tensor of ``count`` values (never a view of a part). Only exactly rounded
        elementwise ops, so the result is the same bits on every device and for every caller."""

    def quantize_into(self, x: torch.Tensor, parts: Parts) -> bool:
        """Write ``quantize(x)``'s parts straight into ``parts`` (typed CPU views of a frame's
        payload, as ``part_layout`` lays them out) and return True; False where this codec
        cannot for this input, and then ``quantize`` runs and its parts are copied there. A
        codec whose kernel takes output pointers overrides this to skip that copy."""
        return False

    def dequantize_into(self, parts: Parts, count: int, out: torch.Tensor) -> torch.Tensor:
        """``dequantize`` written into ``out`` (``count`` fp32 values on the parts' device); a
        codec whose kernel can write there directly overrides this."""
        return out.copy_(self.dequantize(parts, count))

    def dequantize_on(self, parts: Parts, count: int, device: torch.device | str | None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """``dequantize`` (into ``out`` if given) of the CPU ``parts`` of a checked frame, the values
        on ``device`` (None: the CPU). Default: the parts go to the device and are dequantized there;
        a codec whose unpacking is many small host steps overrides this."""
        if device is not None and torch.device(device).type != "cpu":
            parts = [p.to(device) for p in parts]
        if out is not None:
            return self.dequantize_into(parts, count, out)
        return self.dequantize(parts, count)

    def validate(self, parts: Parts, count: int) -> None:
        """Raise FrameError if parts read from a frame hold values the encoder never writes."""

    @property
    def params(self) -> dict:
        """The constructor parameters of this codec."""
        extra = {"stochastic": self.stochastic, "seed": self.seed} if self.supports_stochastic \
            else {}
        return {**extra, "zstd": self.zstd, "zstd_level": self.zstd_level}

    # ---- public API ---------------------------------------------------------------------------
    def payload_size(self, count: int) -> int:
        """Payload bytes (before zstd) for ``count`` values."""
        return sum(n * _itemsize(dt) for dt, n in self.part_layout(count))

    def frame_size(self, count: int) -> int:
        """Frame bytes without zstd for ``count`` values (header and checksum included)."""
        return frame.OVERHEAD + self.payload_size(count)

    def encode(self, x: torch.Tensor) -> Frame:
        """Encode a 1-D float32 tensor (any device) into one complete frame: a bytearray, or
        for a CUDA tensor without zstd a memoryview of the page-locked frame (both bytes-like;
        ``bytes(frame)`` makes an immutable copy)."""
        x = self._check_input(x)
        return self._frame(x)[0]

    def encode_with_decoded(self, x: torch.Tensor, out: torch.Tensor | None = None
                            ) -> tuple[Frame, torch.Tensor]:
        """Encode once and also return exactly what ``decode`` of that frame yields (on x's
        device), without a second encode: the payload just written is dequantized in place.
        With ``out`` (fp32, x's size and device, not overlapping x) the decoded values are
        written there and ``out`` is returned."""
        x = self._check_input(x)
        if out is not None:
            _check_out(out, x.numel(), x.device)
        frame_bytes, views, on_device = self._frame(x)
        if on_device is not None:  # a GPU tensor: the parts as they were copied to the frame
            views = on_device
        if out is None:
            return frame_bytes, self.dequantize(views, x.numel())
        return frame_bytes, self.dequantize_into(views, x.numel(), out)

    def decode(self, data: bytes | bytearray | memoryview,
               device: torch.device | str | None = None,
               out: torch.Tensor | None = None, count: int | None = None) -> torch.Tensor:
        """Decode a frame made by this codec (any parameters) into a float32 1-D tensor.

        With ``out`` (a contiguous fp32 tensor, on ``device`` if given) the values are written
        there and ``out`` is returned; a frame of another length is a FrameError.
        With ``count`` (the number of values the caller expects), a frame declaring another
        count is a FrameError before anything is decompressed or allocated, so a small zstd
        frame cannot make the decoder expand it to a size the caller never asked for.
        FrameError if the frame is malformed or was made by another codec."""
        mv = frame.as_buffer(data)
        h, payload = frame.parse(mv)
        if h.codec_id != self.codec_id:
            raise FrameError(f"frame was made by codec {codec_name(h.codec_id)!r}, "
                             f"not {self.name!r}")
        if count is not None and h.count != count:
            raise FrameError(f"frame declares {h.count} values, want {count} fp32 values")
        sender = _from_header(type(self), h.p0, h.p1, h.p2)
        if (sender.mean, sender.clip_median) != (self.mean, self.clip_median):
            raise FrameError(f"frame was made by a group that averages {_averaging(sender)}, this one averages "
                             f"{_averaging(self)}: every group must run the same --topk-mean and --topk-clip-median")
        if out is not None:
            if device is not None and torch.device(device) != out.device:
                raise ValueError(f"out is on {out.device}, decoding to {device} was asked for")
            _check_out(out, out.numel(), out.device)
            if h.count != out.numel():
                raise FrameError(f"frame holds {h.count} values, out has room for {out.numel()}")
            device = out.device
        return decode_parsed(type(self), h, payload, device, out)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"get_codec({self.name!r}, {args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.params == self.params

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.params.items()))))

    # ---- internals ----------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise TypeError(f"{self.name} encodes float32 tensors, got {x.dtype}")
        if x.dim() != 1:
            raise ValueError(f"{self.name} encodes 1-D tensors, got shape {tuple(x.shape)}")
        if x.numel() > frame.MAX_ELEMENTS:
            raise ValueError(f"{x.numel()} elements exceed frame.MAX_ELEMENTS={frame.MAX_ELEMENTS}")
        return x.contiguous()

    def _frame(self, x: torch.Tensor) -> tuple[Frame, Parts, Parts | None]:
        """The frame of x, CPU views of its payload parts (as a decoder will read them) and,
        for a GPU tensor, the same parts on the GPU (in the frame's dtypes: what
        ``encode_with_decoded`` dequantizes there, without copying the views back).
        The parts go straight into the frame's memory: the codec's kernel writes them there
        (``quantize_into``), or they are copied there once, from the GPU by DMA into page-locked
        memory; the frame is returned without another copy."""
        count = x.numel()
        layout = self.part_layout(count)
        raw_len = sum(n * _itemsize(dt) for dt, n in layout)
        p0, p1, p2 = self.header_params
        if self.zstd:
            payload = torch.empty(raw_len, dtype=torch.uint8, pin_memory=x.is_cuda)
            views = _part_views(payload, layout)
            copied = _copy_parts(views, self.quantize(x))
            flags = frame.FLAG_ZSTD
            if self.shuffle_width > 1:
                payload = entropy.shuffle(payload, self.shuffle_width)
                flags |= frame.FLAG_SHUFFLE
            packed = entropy.compress(memoryview(payload.numpy()), self.zstd_level)
            head = frame.pack_header(frame.Header(self.codec_id, flags, p0, p1, p2, count, raw_len,
                                                  len(packed)))
            buf = bytearray(head + packed + bytes(frame.TRAILER_SIZE))
            frame.seal(memoryview(buf))
            return buf, views, copied if x.is_cuda else None
        if x.is_cuda:
            pinned = torch.empty(frame.OVERHEAD + raw_len, dtype=torch.uint8, pin_memory=True)
            out: Frame = memoryview(pinned.numpy())
            body = pinned[frame.HEADER_SIZE:frame.HEADER_SIZE + raw_len]
            views = _part_views(body, layout)
            copied = _copy_parts(views, self.quantize(x))
        else:
            out = bytearray(frame.OVERHEAD + raw_len)
            body = torch.frombuffer(out, dtype=torch.uint8)[frame.HEADER_SIZE:frame.HEADER_SIZE + raw_len]
            views = _part_views(body, layout)
            if not self.quantize_into(x, views):
                _copy_parts(views, self.quantize(x))
        mv = memoryview(out)
        frame.write_header(mv, frame.Header(self.codec_id, 0, p0, p1, p2, count, raw_len, raw_len))
        frame.seal(mv)
        return out, views, copied if x.is_cuda else None


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dt: torch.dtype) -> int:
    if dt not in _ITEMSIZE:
        _ITEMSIZE[dt] = torch.empty((), dtype=dt).element_size()
    return _ITEMSIZE[dt]


def _part_views(dst: torch.Tensor, layout: list[tuple[torch.dtype, int]]) -> Parts:
    """The typed views of the uint8 payload ``dst`` that the parts of ``layout`` occupy."""
    views: Parts = []
    off = 0
    for dt, n in layout:
        nb = n * _itemsize(dt)
        views.append(dst[off:off + nb].view(dt))
        off += nb
    if off != dst.numel():
        raise AssertionError("codec parts do not match its part_layout")
    return views


def _copy_parts(views: Parts, parts: Sequence[torch.Tensor]) -> Parts:
    """Copy parts into their views (converting each to its view's dtype on the way); returns
    the parts as copied, flat (those on another device in their view's dtype).

    A part on another device (a GPU) is converted there first: a copy to the host that also
    changes the dtype goes through pageable memory at the source's width (int32 codes for an
    int8 part: 4 x the bytes), where a same-dtype copy into the page-locked frame is one DMA.
    Narrowing integers in range and rounding floats give the same bits on either side."""
    copied: Parts = []
    for v, p in zip(views, parts, strict=True):
        src = p.reshape(-1)
        if src.device != v.device and src.dtype != v.dtype:
            src = src.to(v.dtype)
        if v.numel():
            v.copy_(src)
        copied.append(src)
    return copied


def _check_out(out: torch.Tensor, count: int, device: torch.device) -> None:
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 1
            or out.numel() != count or not out.is_contiguous() or out.device != device):
        raise ValueError(f"out must be a contiguous 1-D float32 tensor of {count} values on {device}, "
                         f"got {getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))} "
                         f"on {getattr(out, 'device', None)}")


def decode_parsed(cls: type[Codec], h: frame.Header, payload: memoryview,
                  device: torch.device | str | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a payload whose frame header has already been checked by ``frame.parse``
    (into ``out`` if given: h.count fp32 values on ``device``)."""
    codec = _from_header(cls, h.p0, h.p1, h.p2)
    expected = codec.payload_size(h.count)
    if h.raw_len != expected:
        raise FrameError(f"{cls.name} payload for {h.count} values must be {expected} bytes, "
                         f"header says {h.raw_len}")
    if h.flags & frame.FLAG_ZSTD:
        payload = memoryview(entropy.decompress(payload, h.raw_len))
    raw = _readonly_view(payload) if len(payload) else torch.empty(0, dtype=torch.uint8)
    if h.flags & frame.FLAG_SHUFFLE:
        raw = entropy.unshuffle(raw, cls.shuffle_width)  # a new tensor
    parts: Parts = []
    off = 0
    for dt, n in codec.part_layout(h.count):
        nb = n * _itemsize(dt)
        parts.append(raw[off:off + nb].view(dt))
        off += nb
    codec.validate(parts, h.count)
    return codec.dequantize_on(parts, h.count, device, out)


def _averaging(codec: Codec) -> str:
    """How a codec's gather averages, in words (``--topk-mean``, ``--topk-clip-median``)."""
    return f"over {'the groups that sent each index' if codec.mean == MEAN_SENDERS else 'all groups'}" + (
        ", clipped to the median norm" if codec.clip_median else "")


@functools.lru_cache(maxsize=256)
def _from_header(cls: type[Codec], p0: int, p1: int, p2: int) -> Codec:
    # Codecs are immutable, so decoders of the same parameters share one instance.
    return cls.from_header(p0, p1, p2)


def _readonly_view(payload: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: we never write through this view
        return torch.frombuffer(payload, dtype=torch.uint8)
