"""The zstd stage: byte shuffle, threads for large payloads, and the measurement that gates it."""
import torch

import compress
from compress import entropy


def test_shuffle_is_invertible_with_a_ragged_tail():
    data = torch.randint(0, 256, (4 * 10 + 3,), dtype=torch.uint8)
    s = entropy.shuffle(data, 4)
    assert not torch.equal(s, data)
    assert torch.equal(entropy.unshuffle(s, 4), data)
    assert torch.equal(entropy.shuffle(data, 1), data)


def test_shuffle_helps_fp32_compress():
    x = (torch.randn(1 << 15) * 1e-3).to(torch.bfloat16).float()  # low 16 bits all zero
    shuffled = compress.get_codec("fp32", zstd=True).encode(x)
    raw = entropy.compress(x.numpy().tobytes(), 1)
    assert len(shuffled) < len(raw) * 0.9


def test_large_payloads_use_threads_and_still_roundtrip(monkeypatch):
    monkeypatch.setattr(entropy, "MT_THRESHOLD", 1 << 12)
    assert entropy._threads_for(1 << 14) >= 1
    x = torch.randn(1 << 14).mul_(torch.rand(1 << 14) < 0.2)
    codec = compress.get_codec("bf16", zstd=True)
    frame, dec = codec.encode_with_decoded(x)
    assert torch.equal(codec.decode(frame), dec)


def test_zstd_level_is_a_parameter():
    x = torch.randn(1 << 14).mul_(torch.rand(1 << 14) < 0.2)
    fast = compress.get_codec("fp32", zstd=True, zstd_level=1).encode(x)
    slow = compress.get_codec("fp32", zstd=True, zstd_level=19).encode(x)
    assert len(slow) <= len(fast)
    assert torch.equal(compress.decode_frame(slow), compress.decode_frame(fast))


def test_measure_zstd_decides_by_link_speed():
    x = torch.randn(1 << 16).mul_(torch.rand(1 << 16) < 0.1)  # very compressible
    m = compress.measure_zstd(compress.get_codec("fp32"), x)
    assert m.ratio > 2 and m.plain_bytes == 52 + 4 * (1 << 16)
    assert m.pays(1e3)  # 1 kB/s: any saving pays
    assert not m.pays(1e15)  # faster than memory: never pays
    assert m.pays_pipelined(1e3) and not m.pays_pipelined(1e15)
    noise = compress.measure_zstd(compress.get_codec("int8"), torch.rand(1 << 16) * 2 - 1)
    assert noise.ratio < 1.01


def test_pipelined_zstd_pays_where_its_cpu_hides_behind_the_wire():
    """A 77 MB fp32 vector squeezed to 77 % at 0.14 + 0.06 s of CPU: on a 1 Gbit/s ring the CPU runs
    beside the wire (0.62 s plain, 0.47 s squeezed), one chunk after another, so it pays there,
    though not when the stage's CPU is added to the wire time; at 10 Gbit/s the CPU is the floor."""
    m = compress.ZstdMeasurement("fp32", 19_200_000, 76_800_000, 59_136_000, 0.14, 0.06)
    gbit = 1e9 / 8
    assert m.pays_pipelined(gbit) and not m.pays(gbit)
    assert not m.pays_pipelined(10 * gbit)
    assert not compress.ZstdMeasurement("int8", 100, 100, 100, 0.0, 0.0).pays_pipelined(gbit)  # no saving
