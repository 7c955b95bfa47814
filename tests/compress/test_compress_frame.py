"""The frame never trusts its input: every malformation is a FrameError that says what is wrong."""
import struct

import pytest
import torch

import compress
from compress import frame as fr
from compress.entropy import MAX_ZSTD_RATIO


def reseal(buf: bytearray) -> bytes:
    """Fix the CRC after a deliberate edit, so the check behind it is what fails."""
    fr.seal(memoryview(buf))
    return bytes(buf)


def edit(frame: bytes, offset: int, fmt: str, value) -> bytes:
    buf = bytearray(frame)
    struct.pack_into(fmt, buf, offset, value)
    return reseal(buf)


@pytest.fixture
def int8_frame():
    return compress.get_codec("int8", block_size=4).encode(torch.randn(10))


def test_header_layout(int8_frame):
    magic, version, _, flags, res, p0, p1, p2, count, raw, wire = fr.HEADER.unpack_from(int8_frame)
    assert (magic, version, flags, res, p0, count) == (b"DLCF", 1, 0, 0, 4, 10)
    assert raw == wire == 3 * 4 + 10 and len(int8_frame) == 44 + wire + 8


@pytest.mark.parametrize("cut", [0, 1, 43, 51, 54, -1])
def test_truncated(int8_frame, cut):
    with pytest.raises(compress.FrameError, match="shorter|truncated"):
        compress.decode_frame(int8_frame[:cut])


def test_extended(int8_frame):
    with pytest.raises(compress.FrameError, match="trailing bytes"):
        compress.decode_frame(int8_frame + b"\0")


@pytest.mark.parametrize("bit", [44 * 8 + 3, 50 * 8, (44 + 22) * 8 + 7, (44 + 22 + 7) * 8])
def test_bit_flip_in_payload_or_trailer(int8_frame, bit):
    buf = bytearray(int8_frame)
    buf[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(compress.FrameError, match="checksum mismatch"):
        compress.decode_frame(bytes(buf))


@pytest.mark.parametrize("offset,fmt,value,message", [
    (0, "4s", b"XXXX", "bad magic"),
    (4, "B", 2, "unsupported frame version 2"),
    (5, "B", 200, "unknown codec id 200"),
    (6, "B", 0x80, "unknown flag bits"),
    (6, "B", 2, "shuffle flag set without zstd"),
    (7, "B", 1, "reserved header byte"),
    (8, "I", 0, "block_size must be in"),
    (8, "I", 1 << 21, "block_size must be in"),
    (12, "I", 5, "nonzero unused parameters"),
    (20, "Q", 11, "payload for 11 values must be"),
    (20, "Q", 1 << 40, "more than MAX_ELEMENTS"),
    (28, "Q", 23, "raw_len 23 != wire_len 22"),
    (36, "Q", 21, "header says"),
])
def test_header_fields_are_checked(int8_frame, offset, fmt, value, message):
    with pytest.raises(compress.FrameError, match=message):
        compress.decode_frame(edit(int8_frame, offset, fmt, value))


def test_wrong_codec_id_for_the_payload_is_caught():
    f = compress.get_codec("int8", block_size=2).encode(torch.randn(8))
    with pytest.raises(compress.FrameError, match="int4 header has group size 0"):
        compress.decode_frame(edit(f, 5, "B", 5))
    f = compress.get_codec("int4", block_size=2).encode(torch.randn(8))
    with pytest.raises(compress.FrameError, match="int8 payload"):
        compress.decode_frame(edit(edit(f, 12, "<I", 0), 5, "B", 4))


def test_4bit_layout_is_in_the_header():
    """The 4-bit codecs' frames say their layout (p1 = 256 blocks per anchor): a build that reads
    another layout refuses them instead of misreading the payload, and this build refuses the
    older layout (p1 = 0, one fp32 scale per block)."""
    for name in ("int4", "fp4-e2m1", "fp4-e3m0", "lloyd4"):
        f = compress.get_codec(name).encode(torch.randn(100))
        assert fr.HEADER.unpack_from(f)[5:8] == (32, 256, 0)
        for p1 in (0, 128, 257):
            with pytest.raises(compress.FrameError, match=f"group size {p1}, this build reads 256"):
                compress.decode_frame(edit(f, 12, "<I", p1))
        with pytest.raises(compress.FrameError, match="nonzero unused parameter 1"):
            compress.decode_frame(edit(f, 16, "<I", 1))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_bad_scales_are_rejected(int8_frame, value):
    with pytest.raises(compress.FrameError, match="NaN, infinite or negative scale"):
        compress.decode_frame(edit(int8_frame, 44, "<f", value))


def test_topk_indices_must_be_ascending_and_inside_the_chunk():
    codec = compress.get_codec("topk", chunk=16, k=2, value_bits=4, indices="fixed")
    f = codec.encode(torch.arange(16.0))  # keeps indices 14, 15 -> 4-bit fields 0xE, 0xF
    idx_at = 44 + 8 + 1
    assert f[idx_at] == 0xFE
    with pytest.raises(compress.FrameError, match="not strictly ascending"):
        compress.decode_frame(edit(f, idx_at, "B", 0xEF))
    with pytest.raises(compress.FrameError, match="not strictly ascending"):
        compress.decode_frame(edit(f, idx_at, "B", 0xEE))
    short = compress.get_codec("topk", chunk=16, k=2, value_bits=4, indices="fixed").encode(torch.arange(10.0))
    with pytest.raises(compress.FrameError, match="outside its chunk"):
        compress.decode_frame(edit(short, idx_at, "B", 0xF8))


def test_elias_fano_indices_are_checked_like_fixed_ones():
    codec = compress.get_codec("topk", chunk=16, k=2, value_bits=4)  # L = 3 low bits, a 4-bit bitmap
    f = codec.encode(torch.arange(16.0))  # keeps 14, 15: low fields 6, 7; high parts 1, 1
    low_at, bitmap_at = 44 + 8 + 1, 44 + 8 + 2
    assert (f[low_at], f[bitmap_at]) == (6 | 7 << 3, 0b0110)
    assert torch.equal(compress.decode_frame(edit(f, bitmap_at, "B", 0b0011))[6:8], compress.decode_frame(f)[14:])
    with pytest.raises(compress.FrameError, match="not strictly ascending"):
        compress.decode_frame(edit(f, low_at, "B", 7 | 6 << 3))  # 15, 14
    with pytest.raises(compress.FrameError, match="does not hold 2 indices"):
        compress.decode_frame(edit(f, bitmap_at, "B", 0b0111))
    short = codec.encode(torch.arange(10.0))  # a 10-value chunk: L = 2, a 5-bit bitmap; keeps 8, 9
    assert short[bitmap_at] == 0b01100
    with pytest.raises(compress.FrameError, match="beyond its chunk of 10"):
        compress.decode_frame(edit(short, bitmap_at, "B", 0b11000))  # 12, 13


def test_zstd_bomb_is_refused_before_allocating():
    f = compress.get_codec("fp32", zstd=True).encode(torch.zeros(1000))
    wire = struct.unpack_from("<Q", f, 36)[0]
    count = (MAX_ZSTD_RATIO * wire + 4096) // 4
    buf = bytearray(edit(f, 20, "<Q", count))
    struct.pack_into("<Q", buf, 28, count * 4)
    with pytest.raises(compress.FrameError, match="more than zstd can expand to"):
        compress.decode_frame(reseal(buf))


def test_zstd_garbage_and_size_lies():
    f = bytearray(compress.get_codec("fp32", zstd=True).encode(torch.randn(100)))
    lie = bytearray(f)
    struct.pack_into("<Q", lie, 20, 99)
    struct.pack_into("<Q", lie, 28, 396)
    with pytest.raises(compress.FrameError, match="zstd frame declares 400"):
        compress.decode_frame(reseal(lie))
    f[44] ^= 0xFF  # the zstd magic number
    with pytest.raises(compress.FrameError, match="zstd"):
        compress.decode_frame(reseal(f))


def test_bytes_after_the_zstd_frame_are_refused():
    """A payload is one zstd frame and nothing else: junk or a second frame behind it is an error."""
    f = compress.get_codec("fp32", zstd=True).encode(torch.randn(100))
    wire = struct.unpack_from("<Q", f, 36)[0]
    payload = bytes(f[fr.HEADER_SIZE:fr.HEADER_SIZE + wire])
    for extra in (b"JUNK", payload):
        buf = bytearray(f[:fr.HEADER_SIZE]) + payload + extra + bytearray(fr.TRAILER_SIZE)
        struct.pack_into("<Q", buf, 36, wire + len(extra))
        with pytest.raises(compress.FrameError, match="unused data"):
            compress.decode_frame(reseal(buf))


def test_decode_frame_with_a_count_refuses_another_before_decompressing():
    f = compress.get_codec("fp32", zstd=True).encode(torch.randn(100))
    assert compress.decode_frame(f, count=100).numel() == 100
    with pytest.raises(compress.FrameError, match="frame declares 100 values, want 99"):
        compress.decode_frame(f, count=99)


@pytest.mark.parametrize("bad", ["a string", 12, None, [1, 2], torch.zeros(3)])
def test_non_bytes_input(bad):
    with pytest.raises(compress.FrameError, match="must be bytes"):
        compress.decode_frame(bad)


def test_memoryview_of_other_formats_and_slices():
    f = compress.get_codec("int4").encode(torch.randn(33))
    big = bytearray(b"xx" + f + b"yy")
    assert torch.equal(compress.decode_frame(memoryview(big)[2:-2]), compress.decode_frame(f))
    with pytest.raises(compress.FrameError, match="not contiguous"):
        compress.decode_frame(memoryview(big)[::2])


def test_max_elements_is_enforced_on_encode_too(monkeypatch):
    monkeypatch.setattr(fr, "MAX_ELEMENTS", 100)
    with pytest.raises(ValueError, match="MAX_ELEMENTS"):
        compress.get_codec("fp32").encode(torch.zeros(101))
    f = compress.get_codec("fp32").encode(torch.zeros(100))
    assert compress.decode_frame(f).numel() == 100


def test_trailer_of_parts_seals_like_the_joined_frame():
    codec = compress.get_codec("fp32")
    x = torch.randn(1000)
    whole = codec.encode(x)
    head = whole[:fr.HEADER_SIZE]
    body = memoryview(x.numpy()).cast("B")
    assert head + bytes(body) + fr.trailer(head, body) == whole
    assert fr.trailer(head, body[:-1]) != whole[-fr.TRAILER_SIZE:]
