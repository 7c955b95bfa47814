"""The public API: names, construction errors, frames of the right codec, empty tensors."""
import pytest
import torch

import compress
from compress_helpers import REQUIRED, SMALL


def test_required_codecs_are_available():
    names = compress.available_codecs()
    for name in REQUIRED:
        assert name in names
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", compress.available_codecs())
def test_codec_has_its_name_and_roundtrips_shape(name):
    codec = compress.get_codec(name, **SMALL[name])
    assert codec.name == name
    x = torch.randn(37)
    y = codec.decode(codec.encode(x))
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert compress.get_codec(name, **SMALL[name]) == codec


def test_unknown_codec_is_a_clear_value_error():
    with pytest.raises(ValueError, match="unknown codec 'int3'.*int8"):
        compress.get_codec("int3")


@pytest.mark.parametrize("name,params", [
    ("int8", {"block_size": 0}), ("int8", {"block_size": 2.5}), ("int4", {"block_size": 7}),
    ("int8", {"bogus": 1}), ("fp32", {"block_size": 16}), ("topk", {"k": 0}),
    ("topk", {"chunk": 16, "k": 17}), ("topk", {"k": 4, "density": 0.1}),
    ("topk", {"density": 1.5}), ("topk", {"value_bits": 9}), ("bf16", {"zstd": "yes"}),
    ("int8", {"zstd_level": 99}), ("int8", {"stochastic": 1}), ("fp16", {"stochastic": True}),
    ("sign1", {"stochastic": True}), ("int8", {"seed": -1}), ("int4", {"search": 1}),
    ("lloyd4", {"block_size": 0}), ("int8", {"search": True}),
])
def test_bad_parameters_are_value_errors(name, params):
    with pytest.raises(ValueError):
        compress.get_codec(name, **params)


@pytest.mark.parametrize("name", compress.available_codecs())
def test_every_codec_takes_the_common_options(name):
    codec = compress.get_codec(name, zstd=True, zstd_level=3, stochastic=False)
    assert codec.params["zstd_level"] == 3
    assert compress.get_codec(name, **codec.params) == codec


def test_topk_density_sets_k():
    assert compress.get_codec("topk", chunk=4096, density=0.015).k == 61
    assert compress.get_codec("topk").k == 64


@pytest.mark.parametrize("name", compress.available_codecs())
@pytest.mark.parametrize("zstd", [False, True])
def test_empty_tensor_roundtrips(name, zstd):
    codec = compress.get_codec(name, zstd=zstd)
    frame, decoded = codec.encode_with_decoded(torch.empty(0))
    assert decoded.shape == (0,)
    out = compress.decode_frame(frame)
    assert out.shape == (0,) and out.dtype == torch.float32


def test_decoding_with_another_codec_is_a_frame_error():
    frame = compress.get_codec("int8").encode(torch.randn(10))
    with pytest.raises(compress.FrameError, match="made by codec 'int8', not 'int4'"):
        compress.get_codec("int4").decode(frame)
    assert issubclass(compress.FrameError, ValueError)


def test_decode_uses_the_parameters_in_the_header():
    x = torch.randn(100)
    frame = compress.get_codec("int8", block_size=8).encode(x)
    expected = compress.decode_frame(frame)
    assert torch.equal(compress.get_codec("int8", block_size=256).decode(frame), expected)


@pytest.mark.parametrize("bad", [torch.randn(3, 4), torch.randn(5).double(),
                                 torch.arange(5)])
def test_encode_rejects_wrong_shape_or_dtype(bad):
    with pytest.raises((TypeError, ValueError)):
        compress.get_codec("int8").encode(bad)


def test_non_contiguous_input_is_encoded_by_value():
    x = torch.randn(40)[::2]
    codec = compress.get_codec("fp32")
    assert torch.equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize("name", ["int8", "int4", "fp4-e2m1", "fp4-e3m0", "sign1", "topk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantizers_refuse_non_finite_input(name, bad):
    x = torch.randn(64)
    x[5] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        compress.get_codec(name).encode(x)


def test_casts_pass_non_finite_values_through():
    x = torch.tensor([float("inf"), float("-inf"), 1.0])
    for name in ("fp32", "bf16"):
        assert torch.equal(compress.get_codec(name).decode(compress.get_codec(name).encode(x)), x)
    fp32 = compress.get_codec("fp32")
    assert torch.isnan(fp32.decode(fp32.encode(torch.tensor([float("nan")])))).all()


def test_decoded_tensor_is_writable_and_independent_of_the_input():
    x = torch.randn(16)
    frame, dec = compress.get_codec("fp32").encode_with_decoded(x)
    x.zero_()
    assert dec.abs().sum() > 0
    out = compress.get_codec("fp32").decode(bytearray(frame))
    out.add_(1.0)  # must not raise or touch the frame
    assert torch.equal(compress.decode_frame(frame), dec)


def test_peek_reports_the_header():
    frame = compress.get_codec("topk", chunk=64, k=4, zstd=True).encode(torch.randn(200))
    info = compress.peek(frame)
    assert info["codec"] == "topk" and info["count"] == 200 and info["zstd"]
    assert info["params"] == (64, 4, 256 + 2) and info["wire_len"] == len(frame) - 52  # Elias-Fano indices
    fixed = compress.get_codec("topk", chunk=64, k=4, indices="fixed").encode(torch.randn(200))
    assert compress.peek(fixed)["params"] == (64, 4, 2)


def test_frame_size_matches_encode_and_bits_per_value():
    for name in compress.available_codecs():
        codec = compress.get_codec(name)
        assert len(codec.encode(torch.randn(4096))) == codec.frame_size(4096), name
    assert compress.get_codec("int8").frame_size(4096) == 52 + 16 * 4 + 4096
    # 4-bit: one fp32 anchor per 256 blocks of 32, one scale code per block, two codes per byte
    for name in ("int4", "fp4-e2m1", "fp4-e3m0", "lloyd4"):
        assert compress.get_codec(name).frame_size(4096) == 52 + 4 + 128 + 2048
        assert compress.get_codec(name).frame_size(1 << 18) * 8 / (1 << 18) < 4.26
    assert compress.get_codec("sign1").frame_size(4096) == 52 + 16 * 4 + 512
    # topk at 64 of 4096: lo and step, 2-bit values; Elias-Fano 6-bit low fields and a 128-bit bitmap
    assert compress.get_codec("topk").frame_size(4096) == 52 + 8 + 16 + 48 + 16
    assert compress.get_codec("topk", indices="fixed").frame_size(4096) == 52 + 8 + 16 + 96


def test_topk_refuses_non_finite_values_it_would_not_select():
    x = torch.zeros(64)
    x[0] = 1e30
    x[7] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        compress.get_codec("topk", chunk=64, k=1).encode(x)


@pytest.mark.parametrize("name", compress.available_codecs())
def test_decode_and_encode_with_decoded_into_a_given_buffer(name):
    codec = compress.get_codec(name, **SMALL[name])
    x = torch.randn(3001)
    frame, mine = codec.encode_with_decoded(x)
    into = torch.full((3001,), float("nan"))
    assert codec.decode(frame, out=into) is into
    assert torch.equal(into.view(torch.int32), mine.view(torch.int32))
    again = torch.full((3001,), float("nan"))
    frame2, got = codec.encode_with_decoded(x, out=again)
    assert got is again and frame2 == frame
    assert torch.equal(again.view(torch.int32), mine.view(torch.int32))


def test_decode_into_a_buffer_of_another_length_is_refused():
    codec = compress.get_codec("int4")
    frame = codec.encode(torch.randn(100))
    with pytest.raises(compress.FrameError, match="holds 100 values"):
        codec.decode(frame, out=torch.empty(99))
    for bad in (torch.empty(100, dtype=torch.float64), torch.empty(200)[::2], torch.empty(10, 10)):
        with pytest.raises(ValueError, match="out must"):
            codec.decode(frame, out=bad)
    with pytest.raises(ValueError, match="out must"):
        codec.encode_with_decoded(torch.randn(100), out=torch.empty(101))
