"""bench/convergence_report.py's paired table: the t quantile, the paired mean and its interval, which
fp32 DiLoCo row is the reference, and a seed the reference lacks, on hand-computed records."""

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
report = importlib.import_module("bench.convergence_report")


def rec(row: str, seed: int, loss: float, *, size: str = "small", mode: str = "blocking", codec: str = "fp32",
        groups: int = 2, stage: str = "study", **kw) -> dict:
    return {"size": size, "row": row, "seed": seed, "eval_loss": loss, "mode": mode, "codec": codec,
            "groups": groups, "stage": stage, **kw}


def rows(row: str, losses: dict[int, float], **kw) -> list[dict]:
    return [rec(row, s, x, **kw) for s, x in losses.items()]


@pytest.mark.parametrize("p, dof, want", [(0.975, 4, 2.7764), (0.975, 1, 12.7062), (0.975, 2, 4.3027),
                                          (0.975, 3, 3.1824), (0.975, 9, 2.2622), (0.95, 4, 2.1318),
                                          (0.025, 4, -2.7764), (0.975, 100_000, 1.9600)])
def test_t_quantile_matches_the_tables(p, dof, want):
    assert report.t_quantile(p, dof) == pytest.approx(want, abs=1e-4)


def test_t_cdf_inverts_the_quantile_and_rejects_nonsense():
    assert report.t_cdf(report.t_quantile(0.9, 7), 7) == pytest.approx(0.9, abs=1e-10)
    assert report.t_cdf(0.0, 3) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        report.t_quantile(1.0, 4)
    with pytest.raises(ValueError):
        report.t_quantile(0.975, 0)


def test_paired_mean_and_interval_by_hand():
    # reference 2.0 on every seed; the row 2.02, 2.00, 2.04, 2.01, 2.03: +1, 0, +2, +0.5, +1.5 %
    recs = rows("ref", {s: 2.0 for s in range(1, 6)}) + \
        rows("x", {1: 2.02, 2: 2.00, 3: 2.04, 4: 2.01, 5: 2.03}, codec="int4")
    p = report.paired_against(recs, "small", "x", "ref", [1, 2, 3, 4, 5])
    assert p.diffs == pytest.approx((1.0, 0.0, 2.0, 0.5, 1.5)) and p.n == 5
    assert p.mean == pytest.approx(1.0)
    half = 2.7764 * math.sqrt(2.5 / 4) / math.sqrt(5)  # sd of the diffs: sqrt(sum (d - 1)^2 / 4) = sqrt(2.5 / 4)
    assert half == pytest.approx(0.98161, abs=1e-5)
    assert (p.low, p.high) == (pytest.approx(1.0 - half, abs=1e-4), pytest.approx(1.0 + half, abs=1e-4))
    assert p.t == pytest.approx(2.7764, abs=1e-4)
    one = report.paired_stats([0.7])
    assert (one.mean, one.low, one.high, one.n) == (0.7, None, None, 1)


def test_the_reference_is_the_lowest_fp32_diloco_row_covering_the_most_seeds():
    five = range(1, 6)
    recs = (rows("m2-h30", {s: 2.0 for s in five})
            + rows("m2-h100", {s: 2.1 for s in five})            # same seeds, higher: not chosen
            + rows("m2-h50", {1: 1.9})                           # lower, but one seed only
            + rows("m4-h30", {s: 1.5 for s in five}, groups=4)   # another M
            + rows("m2-int4", {s: 1.8 for s in five}, codec="int4")  # not fp32
            + rows("dp", {s: 1.7 for s in five}, mode="dp")      # data parallel
            + rows("eager", {s: 1.6 for s in five}, mode="eager")  # another algorithm
            + rows("slo", {s: 1.6 for s in five}, outer_rule="sparseloco")
            + rows("m2-h30", {s: 1.0 for s in five}, size="medium")  # another size
            + rows("sw", {s: 1.0 for s in five}, stage="sweep")  # another stage
            + rows("x", {s: 2.05 for s in five}, codec="int2"))
    ref = report.best_fp32_reference(recs, "small", "x")
    assert ref == report.Reference("m2-h30", (1, 2, 3, 4, 5), (), 2)  # best of m2-h30 and m2-h100
    one = rows("y", {1: 2.0}, codec="int2")
    assert report.best_fp32_reference(recs + one, "small", "y").row == "m2-h50"  # on seed 1 alone, the lowest
    assert report.best_fp32_reference(recs, "small", "m2-h30").row == "m2-h30"  # the best is its own reference
    assert report.best_fp32_reference(recs, "small", "m4-h30").row == "m4-h30"
    assert report.best_fp32_reference(rows("z", {1: 2.0}, groups=8, codec="int2"), "small", "z") is None
    # a lower mean over the shared seeds wins among equal coverage even if its other seeds are worse
    recs2 = rows("a", {1: 2.0, 2: 2.0, 3: 2.0}) + rows("b", {1: 1.9, 2: 1.9, 3: 1.9, 9: 9.0}) \
        + rows("x", {1: 2.0, 2: 2.0, 3: 2.0}, codec="int4")
    assert report.best_fp32_reference(recs2, "small", "x").row == "b"


def test_a_seed_the_reference_lacks_is_left_out_and_said():
    recs = rows("m2-h30", {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0}) + \
        rows("x", {1: 2.02, 2: 2.04, 3: 2.00, 4: 2.02, 5: 9.0}, codec="int2")
    ref = report.best_fp32_reference(recs, "small", "x")
    assert ref.seeds == (1, 2, 3, 4) and ref.missing == (5,)
    p = report.paired_against(recs, "small", "x", ref.row, ref.seeds)
    assert p.mean == pytest.approx(1.0) and p.n == 4 and p.t == pytest.approx(3.1824, abs=1e-4)  # seed 5 (9.0) unused
    line = next(ln for ln in report.paired_table(recs).splitlines() if "| x |" in ln)
    assert "seeds 5 not paired" in line and "| 1-4 |" in line and "| 4 |" in line


def test_table_lines_for_a_reference_a_single_seed_and_many_seeds():
    recs = rows("m2-h30", {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0, 5: 2.0}) + \
        rows("x", {1: 2.02, 2: 2.00, 3: 2.04, 4: 2.01, 5: 2.03}, codec="int4") + rows("y", {1: 1.98}, codec="int2")
    text = report.paired_table(recs)
    lines = {ln.split("|")[2].strip(): ln for ln in text.splitlines()[2:]}
    assert "**this row**" in lines["m2-h30"] and "reference" in lines["m2-h30"]
    assert "+1.00 / +0.00 / +2.00 / +0.50 / +1.50 | **+1.00** | +0.02 .. +1.98 | 5 |" in lines["x"]
    assert "m2-h30 (best of 1)" in lines["x"]
    assert "| −1.00 | **−1.00** | — (one seed) | 1 |" in lines["y"]


def test_cli_prints_the_paired_table(tmp_path, capsys):
    conv = importlib.import_module("bench.convergence")
    recs = rows("m2-h30", {1: 2.0, 2: 2.0}) + rows("x", {1: 2.02, 2: 2.04}, codec="int4")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(recs))
    assert conv.main(["--paired", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| small | x | 2 | int4 | m2-h30 (best of 1) | 1, 2 | +1.00 / +2.00 | **+1.50** |" in out


def test_a_named_reference_pairs_every_row_of_its_size_on_shared_seeds():
    recs = rows("m2-h30", {1: 2.0, 2: 2.0, 3: 2.0}) + rows("m2-h200", {1: 2.1, 2: 2.1}) + \
        rows("x", {1: 2.121, 2: 2.142, 3: 2.0}, codec="int2") + rows("m2-h200", {1: 1.0}, size="medium") + \
        rows("y", {1: 2.0}, size="other", codec="int2")
    ref = report.named_reference(recs, "small", "x", "m2-h200")
    assert ref == report.Reference("m2-h200", (1, 2), (3,), 1)  # not the best (m2-h30): the one named
    text = report.paired_table(recs, against="m2-h200")
    line = next(ln for ln in text.splitlines() if "| small | x |" in ln)
    assert "m2-h200 (named; seeds 3 not paired" in line and "+1.00 / +2.00 | **+1.50** |" in line
    assert "| other |" not in text  # a size without the named row is left out
    assert "m2-h200 shares no seed" not in text and "| medium | m2-h200 |" in text


def test_the_study_records_give_the_paced_int2_headlines():
    """bench/results/convergence.json: the paced int2 rows against fp32 DiLoCo H=30 over 5 paired seeds, the
    best of the 5 fp32 DiLoCo rows run on seeds 1-5 (H=100 among them since 2026-11-29), and against H=100 named."""
    recs = json.loads((ROOT / "bench" / "results" / "convergence.json").read_text())
    for row, mean, low, high, vs_h100 in (
            ("m2-paced200-int2b1024-int4final-decay0-zstd-outer", 0.86, -0.24, 1.95, (0.49, -0.38, 1.37)),
            ("m2-paced200-int2b1024-int4final-decay0-zstd-p2-tau15-a0-outer", 0.88, 0.50, 1.26, (0.52, -0.83, 1.87))):
        ref = report.best_fp32_reference(recs, "small-xlong", row)
        assert (ref.row, ref.seeds, ref.missing, ref.candidates) == ("m2-h30-outer", (1, 2, 3, 4, 5), (), 5)
        p = report.paired_against(recs, "small-xlong", row, ref.row, ref.seeds)
        assert (round(p.mean, 2), round(p.low, 2), round(p.high, 2)) == (mean, low, high), row
        named = report.named_reference(recs, "small-xlong", row, "m2-h100-outer")
        assert (named.seeds, named.missing) == ((1, 2, 3, 4, 5), ())
        q = report.paired_against(recs, "small-xlong", row, named.row, named.seeds)
        assert (round(q.mean, 2), round(q.low, 2), round(q.high, 2)) == vs_h100, row
