"""The optional C kernels (compress/_native.c) give the same bits as the torch path."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import compress
from compress.codecs import blockwise

native = pytest.mark.skipif(blockwise._native is None,
                            reason="compress._native not built (pip install -e .)")


@pytest.fixture(autouse=True)
def _native_on():
    before, blockwise.USE_NATIVE = blockwise.USE_NATIVE, True
    yield
    blockwise.USE_NATIVE = before
NAMES = ["int8", "int4", "fp4-e2m1", "fp4-e3m0", "lloyd4"]
FOUR_BIT = NAMES[1:]


def both_paths(codec, x):
    """(frame, decoded) from the C kernels and from the torch path, or the ValueError text."""
    out, before = [], blockwise.USE_NATIVE
    for use in (True, False):
        blockwise.USE_NATIVE = use
        try:
            out.append(codec.encode_with_decoded(x))
        except ValueError as e:
            out.append(str(e))
        finally:
            blockwise.USE_NATIVE = before
    return out


def assert_same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    assert a[0] == b[0]  # the frames, byte for byte
    assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


@native
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block", [2, 8, 128, 256, 4098, 20000])
def test_native_matches_torch_on_random_inputs(name, block):
    g = torch.Generator().manual_seed(block)
    for n in (1, 2, 3, 127, 128, 129, 1001, 70001):
        for scale in (1e-38, 1e-20, 1e-3, 1.0, 1e20):
            x = torch.randn(n, generator=g) * scale
            x[::7] = 0.0
            x[1::11] = -0.0
            x[3::13] *= 1e-20  # subnormal and tiny values next to normal ones
            codec = compress.get_codec(name, block_size=block)
            assert_same(*both_paths(codec, x))


@native
@pytest.mark.parametrize("block", [2, 8, 128, 20000])
def test_native_matches_torch_without_and_with_search(block):
    g = torch.Generator().manual_seed(block + 1)
    for name in FOUR_BIT:
        for search in (False, True):
            codec = compress.get_codec(name, block_size=block, search=search)
            for n in (1, 3, 1001, 70001):
                # magnitudes over 80 octaves: every scale code, and blocks far below their group
                x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
                x[::9] = 0.0
                assert_same(*both_paths(codec, x))


def test_native_matches_torch_on_level_boundaries_int8():
    # values on and next to every rounding boundary, in blocks of absmax 1
    codec = compress.get_codec("int8", block_size=64)
    mids = torch.tensor([k + 0.5 for k in range(8)] + [2.0 ** -k * 0.75 for k in range(9)])
    v = torch.cat([mids / 127, torch.tensor([0.25, 1.25, 1.75, 2.5, 3.5, 5.0]) / 127])
    v = torch.cat([v, v.nextafter(torch.tensor(0.0)), v.nextafter(torch.tensor(9.0))])
    v = torch.cat([v, -v])
    x = torch.cat([torch.cat([torch.ones(1), chunk]) for chunk in v.split(63)])
    assert_same(*both_paths(codec, x))


@native
@pytest.mark.parametrize("name", FOUR_BIT)
@pytest.mark.parametrize("search", [False, True])
def test_native_matches_torch_on_level_boundaries(name, search):
    """Values on and next to every boundary between two levels (and the clipping point), in units
    of the scale each block gets without search: blocks of 64 led by the group's absmax."""
    codec = compress.get_codec(name, block_size=64, search=search)
    t = codec._tables(torch.device("cpu"))
    lev = torch.tensor(codec.levels, dtype=torch.float64)
    bounds = torch.cat([(lev[1:] + lev[:-1]) / 2, lev, torch.tensor([codec.qn])])
    if name == "fp4-e3m0":  # its boundaries: 0.75 * 2^k (and 2^-7 for zero)
        bounds = torch.cat([bounds, 0.75 * torch.exp2(-torch.arange(8.0)).double()])
    xs = []
    for absmax in (1.0, 3.0e-20, 7.5e30):
        A = torch.tensor(absmax)
        k0 = max(k for k in range(256) if absmax <= float(A * t["U"][k] * codec.qn))
        u = float(A * t["U"][k0])
        v = (bounds * u).float()
        v = torch.cat([v, v.nextafter(torch.tensor(0.0)), v.nextafter(torch.tensor(float("inf")))])
        v = v[(v > 0) & (v <= absmax)]
        v = torch.cat([v, -v])
        group = torch.cat([torch.cat([torch.full((1,), absmax), chunk]) for chunk in v.split(63)])
        assert group.numel() <= 256 * 64
        xs.append(torch.cat([group, torch.zeros(256 * 64 - group.numel())]))  # its own anchor
    assert_same(*both_paths(codec, torch.cat(xs)))


@native
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_native_rejects_non_finite_like_torch(name, bad):
    x = torch.randn(1000)
    x[777] = bad
    a, b = both_paths(compress.get_codec(name), x)
    assert isinstance(a, str) and a == b


finite = st.floats(-2.0 ** 127, 2.0 ** 127, allow_nan=False, allow_infinity=False, width=32)


@native
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=st.integers(0, 600).flatmap(lambda n: arrays(np.float32, n, elements=finite))
       .map(torch.from_numpy),
       name=st.sampled_from(NAMES), block=st.sampled_from([2, 4, 16, 64, 128]))
def test_native_matches_torch_on_arbitrary_floats(x, name, block):
    assert_same(*both_paths(compress.get_codec(name, block_size=block), x))


@native
def test_native_is_used_on_cpu_only_for_round_to_nearest():
    x = torch.randn(1000)
    assert blockwise._native_for(x)
    blockwise.USE_NATIVE = False
    assert not blockwise._native_for(x)
    blockwise.USE_NATIVE = True
    # stochastic rounding stays on the torch path and still decodes identically
    codec = compress.get_codec("int4", stochastic=True, seed=3)
    frame, mine = codec.encode_with_decoded(x)
    assert torch.equal(codec.decode(frame).view(torch.int32), mine.view(torch.int32))


@native
@pytest.mark.parametrize("name", NAMES)
def test_native_encode_writes_its_parts_straight_into_the_frame(name, monkeypatch):
    """On CPU the kernels write the scales and codes into the frame's own memory: no parts are
    made and copied there (``quantize`` never runs), and the frame is returned as it was written
    (a bytearray, not copied into bytes), byte for byte the torch path's frame."""
    codec = compress.get_codec(name)
    x = torch.randn(70001, generator=torch.Generator().manual_seed(5))
    reference = both_paths(codec, x)[1]
    monkeypatch.setattr(type(codec), "quantize", lambda self, x: pytest.fail("quantize ran"))
    frame, mine = codec.encode_with_decoded(x)
    assert isinstance(frame, bytearray)
    assert frame == reference[0]
    assert torch.equal(mine.view(torch.int32), reference[1].view(torch.int32))
    assert torch.equal(codec.decode(frame).view(torch.int32), mine.view(torch.int32))


@native
@pytest.mark.parametrize("name", NAMES)
def test_decoding_into_a_strided_output_takes_the_generic_path_with_the_same_bits(name):
    """The C decoders write through a data pointer: an output they cannot write that way (a
    strided view) gets the generic path, and the same values, instead of scattered memory."""
    codec = compress.get_codec(name)
    x = torch.randn(1001, generator=torch.Generator().manual_seed(9))
    frame, mine = codec.encode_with_decoded(x)
    parts = codec.quantize(x)
    backing = torch.full((2 * 1001,), 7.0)
    out = backing[::2]
    codec.dequantize_into(parts, 1001, out)
    assert torch.equal(out.view(torch.int32), mine.view(torch.int32))
    assert torch.equal(backing[1::2], torch.full((1001,), 7.0))  # nothing written between them


@native
@pytest.mark.parametrize("width", [2, 3, 4, 8, 9])
@pytest.mark.parametrize("length", [0, 1, 7, 4096, 4096 * 3 + 5])
def test_native_byte_shuffle_matches_torch(width, length):
    from compress import entropy

    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(length + width))
    blockwise.USE_NATIVE = False
    want = entropy.shuffle(data, width)
    blockwise.USE_NATIVE = True
    got = entropy.shuffle(data, width)
    assert torch.equal(got, want)
    assert torch.equal(entropy.unshuffle(got, width), data)
    blockwise.USE_NATIVE = False
    assert torch.equal(entropy.unshuffle(got, width), data)


@native
@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_native_shuffle_gives_the_same_zstd_frames(name):
    """The entropy stage's frames are the same bytes with and without the C transpose."""
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(3)) * 1e-3
    codec = compress.get_codec(name, zstd=True)
    a, b = both_paths(codec, x)
    assert_same(a, b)
    assert torch.equal(codec.decode(a[0]).view(torch.int32), a[1].view(torch.int32))
