"""bench/convergence_bits.py: bits per parameter per inner step per sending group, as SparseLoCo counts
them and as the wire does, on hand cases, and the wire count against the study's measured bytes."""

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
bits = importlib.import_module("bench.convergence_bits")
from compress.codec_spec import CodecSpec  # noqa: E402


def plain(count: int) -> int:  # a frame of one byte per value, with the real 52 bytes of header and checksum
    return 52 + count


def test_gather_sends_g_minus_1_contributions_with_envelopes():
    # per stripe message: 52 + 10 + 36 + len("t/s0") = 102; two stripes; forwarded G - 1 = 2 times
    assert bits.ENVELOPE == 36
    assert bits.gather_bytes(plain, [10, 10], 3, tag="t") == 2 * 2 * 102
    assert bits.gather_bytes(plain, [10, 10], 2, tag="t") == 2 * 102
    assert bits.gather_bytes(plain, [10], 3, tag="t", chunk_elems=4) == 2 * (3 * (52 + 36 + 4) + 10)  # 3 chunks


def test_ring_sends_two_g_minus_1_over_g_of_the_segments():
    # one stripe of 12 values, G = 3: segments of 4, each message 52 + 4 + 36 + 4 = 96; 2 (G-1) / G of 3 of them
    assert bits.ring_bytes(plain, [12], 3, tag="t") == pytest.approx(2 * 2 / 3 * 3 * 96)
    assert bits.ring_bytes(plain, [12], 2, tag="t") == pytest.approx(2 * (52 + 6 + 40))  # G = 2: 2 halves, once each


def test_probes_per_group_and_reprobes():
    assert bits.probe_bytes_per_group(3, 0, 100, 100) == 0 and bits.probe_bytes_per_group(1, 1000, 100, 100) == 0
    per_peer = 2 * 37 + 3 * (1 + 1000 + 72)
    assert bits.probe_bytes_per_group(2, 1000, 50, 100) == per_peer
    assert bits.probe_bytes_per_group(3, 1000, 250, 100) == 3 * 2 * per_peer  # at start, after 100 and 200
    assert bits.probe_bytes_per_group(3, 1000, 250, 0) == 2 * per_peer


def test_budget_on_a_hand_case():
    int2 = CodecSpec(codec="int2", codec_block=1024).build()  # 4096 values: 4 scales (16 B) + 1024 B of codes
    assert int2.payload_size(4096) == 1040
    b2 = bits.budget(int2, 4096, 100, 10, 2)
    assert b2.sparseloco_bits == pytest.approx(8 * 1040 * 10 / (4096 * 100))  # 0.203125: payload / params / H
    b3, b4 = bits.budget(int2, 4096, 100, 10, 3), bits.budget(int2, 4096, 100, 10, 4)
    assert b3.sparseloco_bits == b4.sparseloco_bits == b2.sparseloco_bits  # SparseLoCo's count ignores G
    assert b3.exchange_bytes == 2 * b2.exchange_bytes and b4.exchange_bytes == 3 * b2.exchange_bytes  # all-gather
    frames = sum(int2.frame_size(n) + 36 + len(f"f0/r100/s{i}") for i, n in enumerate(bits.stripe_sizes(4096)))
    assert b2.exchange_bytes == 10 * frames and b2.final_bytes == 0 and b2.probe_bytes == 0
    assert b2.wire_bits == pytest.approx(8 * (b2.exchange_bytes + b2.init_bytes) / (4096 * 100))
    int4 = CodecSpec(codec="int4").build()
    f = bits.budget(int2, 4096, 100, 10, 2, final_codec=int4)
    assert f.exchange_bytes == 9 * frames and f.final_bytes > 0  # the last exchange is int4's ring
    z = bits.budget(int2, 4096, 100, 10, 2, zstd_ratio=0.5)
    assert z.exchange_bytes == b2.exchange_bytes / 2
    two = bits.budget(int2, 4096, 100, 10, 2, fragments=2)  # 10 exchanges of half the vector
    assert two.sparseloco_bits == pytest.approx(8 * int2.payload_size(2048) * 10 / (4096 * 100))


def test_wire_count_matches_the_measured_bytes_of_topk_rows():
    """No zstd on SparseLoCo's rows: the count from frame sizes is the measured bytes within 1 %."""
    records = json.loads((ROOT / "bench" / "results" / "convergence.json").read_text())
    for name in ("slo-h30-d1.56", "slo-h100-d3"):
        _, plain_budgets, _, measured, counted = bits._row_budgets(records, name)
        assert counted == pytest.approx(measured, rel=0.01), name
        assert plain_budgets[1].exchange_bytes == pytest.approx(2 * plain_budgets[0].exchange_bytes)


def test_command_line_help_and_a_missing_records_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as shown:
        bits.main(["--help"])
    assert shown.value.code == 0 and "records" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        bits.main([str(tmp_path / "absent.json")])
    assert refused.value.code == 2 and "no records file" in capsys.readouterr().err


def test_a_size_the_records_lack_is_refused_by_name():
    records = json.loads((Path(bits.ROOT) / "bench" / "results" / "convergence.json").read_text())
    with pytest.raises(ValueError, match="at size 'no-such-size'"):
        bits.bits_table(records, "no-such-size")
    for size in ("small-xlong", "medium-xlong"):  # every row the size's records hold, at G = 2, 3, 4
        held = [name for name in bits.ROWS if bits.measured_per_group(records, size, name)]
        assert held and bits.bits_table(records, size).count("\n") == 2 + 3 * len(held) - 1
