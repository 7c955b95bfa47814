"""Values no encoder writes are refused at decode (FrameError), while every frame an encoder does
write still decodes: the scale bounds of the blockwise codecs (compress/codecs/blockwise.py)."""

from __future__ import annotations

import struct

import pytest
import torch

import compress
from compress import frame as fr
from compress.codecs.blockwise import FLT_MAX

BLOCKWISE = ["int8", "int4", "fp4-e2m1", "fp4-e3m0"]


def with_scale(frame: bytes, value: float, block: int = 0) -> bytes:
    """The frame with one block's fp32 scale replaced (checksum redone)."""
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


@pytest.mark.parametrize("name", BLOCKWISE)
@pytest.mark.parametrize("scale", [0.0, 1e-40, 2.0 ** -140])
def test_zero_or_tiny_scale_over_codes_is_refused(name: str, scale: float) -> None:
    codec = compress.get_codec(name)
    frame = with_scale(codec.encode(torch.randn(300)), scale)
    with pytest.raises(compress.FrameError, match="below the smallest its encoder writes"):
        codec.decode(frame)
    with pytest.raises(compress.FrameError, match="below the smallest"):
        codec.decode(with_scale(codec.encode(torch.zeros(300)), scale, block=1))  # zeros too: never written


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_scale_above_what_the_encoder_writes_is_refused(name: str) -> None:
    codec = compress.get_codec(name)
    with pytest.raises(compress.FrameError, match="above the largest its encoder writes"):
        codec.decode(with_scale(codec.encode(torch.randn(300)), FLT_MAX / 2))


@pytest.mark.parametrize("name,code,where", [("int8", -128, None), ("int4", 0x08, "low nibble = -8")])
def test_a_code_never_written_is_refused_where_it_would_overflow(name: str, code: int, where: str | None) -> None:
    """The largest scale an encoder writes times its largest code is finite, but times the one
    code it never writes (int8 -128, int4 -8) it would be -inf."""
    codec = compress.get_codec(name)
    x = torch.full((256,), -FLT_MAX)  # the largest scale there is
    frame = bytearray(codec.encode(x))
    scales = codec.payload_size(256) - (256 if name == "int8" else 128)
    off = fr.HEADER_SIZE + scales
    if name == "int8":
        frame[off] = code & 0xFF
    else:
        frame[off] = (frame[off] & 0xF0) | 0x00  # nibble 0 = code -8
    fr.seal(memoryview(frame))
    with pytest.raises(compress.FrameError, match="never writes"):
        codec.decode(bytes(frame))
    good = codec.encode(x)  # the frame as written decodes, as its encoder says
    assert torch.equal(codec.decode(good), codec.encode_with_decoded(x)[1])


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
