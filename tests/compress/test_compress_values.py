"""Values no encoder writes are refused at decode (FrameError), while every frame an encoder does
write still decodes: the scale bounds and unused codes of the blockwise codecs
(compress/codecs/blockwise.py, block4.py)."""

from __future__ import annotations

import struct

import pytest
import torch

import compress
from compress import frame as fr
from compress.codecs.blockwise import FLT_MAX

BLOCKWISE = ["int8", "int4", "fp4-e2m1", "fp4-e3m0", "lloyd4"]
FOUR_BIT = BLOCKWISE[1:]


def with_scale(frame: bytes, value: float, block: int = 0) -> bytes:
    """The frame with one block's fp32 scale (int8) or one group's fp32 anchor (4-bit codecs)
    replaced (checksum redone)."""
    buf = bytearray(frame)
    struct.pack_into("<f", buf, fr.HEADER_SIZE + 4 * block, value)
    fr.seal(memoryview(buf))
    return bytes(buf)


@pytest.mark.parametrize("name", BLOCKWISE)
@pytest.mark.parametrize("stochastic", [False, True])
def test_extreme_but_real_inputs_still_decode(name: str, stochastic: bool) -> None:
    codec = compress.get_codec(name, stochastic=stochastic, seed=1 if stochastic else None)
    for x in (torch.zeros(300), torch.full((300,), 1e-38), torch.randn(300),
              torch.tensor([3.0e38, -3.0e38] * 150)):
        try:
            frame = codec.encode(x)
        except ValueError:  # fp4's 2^100 scale limit: refused at encode, never sent
            continue
        y = codec.decode(frame)
        assert torch.isfinite(y).all()
        assert torch.equal(y, codec.encode_with_decoded(x)[1]) or stochastic


@pytest.mark.parametrize("scale", [0.0, 1e-40, 2.0 ** -140])
def test_zero_or_tiny_int8_scale_over_codes_is_refused(scale: float) -> None:
    codec = compress.get_codec("int8")
    frame = with_scale(codec.encode(torch.randn(300)), scale)
    with pytest.raises(compress.FrameError, match="below the smallest its encoder writes"):
        codec.decode(frame)
    with pytest.raises(compress.FrameError, match="below the smallest"):
        codec.decode(with_scale(codec.encode(torch.zeros(300)), scale, block=1))  # zeros too: never written


@pytest.mark.parametrize("name", FOUR_BIT)
@pytest.mark.parametrize("scale", [0.0, 1e-40, 2.0 ** -81, 2.0 ** -140])
def test_zero_or_tiny_4bit_anchor_is_refused(name: str, scale: float) -> None:
    """The anchors (one fp32 per 256 blocks) are at least 2^-80: below, a zero or tiny anchor
    would turn its blocks' codes into zeros or subnormals."""
    codec = compress.get_codec(name, block_size=2)  # 1000 values: 500 blocks, two anchors
    for x, group in ((torch.randn(1000), 0), (torch.zeros(1000), 1)):
        with pytest.raises(compress.FrameError, match="below the smallest its encoder writes"):
            codec.decode(with_scale(codec.encode(x), scale, block=group))
    assert torch.equal(codec.decode(codec.encode(torch.zeros(1000))), torch.zeros(1000))


def test_scale_above_what_the_encoder_writes_is_refused() -> None:
    codec = compress.get_codec("int8")
    with pytest.raises(compress.FrameError, match="above the largest its encoder writes"):
        codec.decode(with_scale(codec.encode(torch.randn(300)), FLT_MAX / 2))


@pytest.mark.parametrize("name", FOUR_BIT)
def test_4bit_scale_code_that_would_overflow_is_refused(name: str) -> None:
    """Next to float max the smallest scale codes (the largest scales) would decode the top level
    to infinity: the encoder never picks them, and the decoder refuses them."""
    codec = compress.get_codec(name)
    x = torch.full((64,), -FLT_MAX)
    x[1::2] = FLT_MAX / 3
    frame = codec.encode(x)
    good = codec.decode(frame)
    assert torch.isfinite(good).all() and torch.equal(good, codec.encode_with_decoded(x)[1])
    buf = bytearray(frame)
    buf[fr.HEADER_SIZE + 4] = 0  # block 0's scale code: the largest scale, 4 / qn x the anchor
    fr.seal(memoryview(buf))
    with pytest.raises(compress.FrameError, match="scale code its encoder never writes"):
        codec.decode(bytes(buf))
    # the same code under an ordinary anchor is one the encoder may write
    small = bytearray(codec.encode(torch.randn(64)))
    small[fr.HEADER_SIZE + 4] = 0
    fr.seal(memoryview(small))
    assert torch.isfinite(codec.decode(bytes(small))).all()


def test_int8_code_never_written_is_refused_where_it_would_overflow() -> None:
    """The largest scale an encoder writes times its largest code is finite, but times the one
    code it never writes (int8 -128) it would be -inf."""
    codec = compress.get_codec("int8")
    x = torch.full((256,), -FLT_MAX)  # the largest scale there is
    frame = bytearray(codec.encode(x))
    frame[fr.HEADER_SIZE + 4] = 0x80
    fr.seal(memoryview(frame))
    with pytest.raises(compress.FrameError, match="never writes"):
        codec.decode(bytes(frame))
    good = codec.encode(x)  # the frame as written decodes, as its encoder says
    assert torch.equal(codec.decode(good), codec.encode_with_decoded(x)[1])


@pytest.mark.parametrize("name,nib", [("int4", 0x0), ("fp4-e2m1", 0x8), ("fp4-e3m0", 0x8), ("lloyd4", 0x8)])
@pytest.mark.parametrize("high", [False, True])
def test_4bit_code_never_written_is_refused(name: str, nib: int, high: bool) -> None:
    """int4's nibble 0 (-8) and the sign-magnitude codecs' nibble 8 (minus zero) are never
    written: refused anywhere, except in the padding nibble of an odd count (never decoded)."""
    codec = compress.get_codec(name)
    x = torch.randn(101)
    frame = codec.encode(x)
    assert torch.equal(codec.decode(frame), codec.encode_with_decoded(x)[1])
    codes = fr.HEADER_SIZE + codec.payload_size(101) - 51
    for byte in (0, 17, 49):
        buf = bytearray(frame)
        buf[codes + byte] = (buf[codes + byte] & 0x0F) | nib << 4 if high else (buf[codes + byte] & 0xF0) | nib
        fr.seal(memoryview(buf))
        with pytest.raises(compress.FrameError, match=f"never writes \\(nibble {nib}"):
            codec.decode(bytes(buf))
    buf = bytearray(frame)
    buf[codes + 50] = (buf[codes + 50] & 0x0F) | nib << 4  # value 101's pair: padding, unread
    fr.seal(memoryview(buf))
    assert torch.equal(codec.decode(bytes(buf)), codec.decode(frame))


@pytest.mark.parametrize("name", BLOCKWISE)
def test_non_finite_scales_keep_their_message(name: str) -> None:
    codec = compress.get_codec(name)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(compress.FrameError, match="NaN, infinite or negative scale"):
            codec.decode(with_scale(codec.encode(torch.randn(300)), bad))


def test_fp32_carries_nan_losslessly() -> None:
    """fp32 (and bf16) can write NaN/Inf themselves, so the codec carries them; a collective that
    must not see them asks for it (all_reduce(finite=True))."""
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    for name in ("fp32", "bf16"):
        codec = compress.get_codec(name)
        y = codec.decode(codec.encode(x))
        assert torch.isnan(y[1]) and torch.isinf(y[2]) and y[0] == 1.0


def test_int2_at_the_ends_of_float32() -> None:
    """int2's scale is a block's RMS, taken relative to its peak: values near float32's limit decode
    finite (the scale is clamped so that 1.5104 x scale stays finite) and tiny ones do not vanish;
    a frame with a larger scale, which no encoder writes, is refused."""
    codec = compress.get_codec("int2", block_size=4)
    x = torch.tensor([FLT_MAX, -FLT_MAX, FLT_MAX, FLT_MAX, 1e-30, -2e-30, 0.0, 5e-31])
    y = codec.decode(codec.encode(x))
    assert torch.isfinite(y).all() and (torch.signbit(y) == torch.signbit(x)).all()
    assert y[:4].abs().min() > 1e38 and 1e-31 < y[4:].abs().max() < 1e-29
    with pytest.raises(compress.FrameError, match="scale above"):
        codec.decode(with_scale(codec.encode(x), FLT_MAX))
