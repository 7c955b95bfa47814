"""bench/ecosystem_gap.py: the ecosystem benchmarks' per-seed gaps, the convergence study's row at the same
steps and H, the Welch interval of the difference, and the table's words where the study has no row,
on hand-computed records."""

import importlib
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
gap = importlib.import_module("bench.ecosystem_gap")
report = importlib.import_module("bench.convergence_report")


def hf(seed: int, dp: float, diloco: float, *, h: int = 25, steps: int = 500, lr: float = 1.5e-3) -> dict:
    return {"bench": "hf", "steps": steps, "h": h, "seed": seed, "outer_momentum": 0.7,
            "dp": {"eval_loss": dp, "inner_lr": lr, "tokens": 2_048_000},
            "diloco": {"eval_loss": diloco, "inner_lr": lr}}


def titan(dp: float, diloco: float, outer_lr: float = 0.7) -> dict:
    return {"bench": "titan", "steps": 1000, "h": 20, "lr": 1.6e-3, "dp_lr": 1.6e-3, "outer_lr": outer_lr,
            "outer_momentum": 0.7,
            "dp": {"eval_loss": dp, "tokens": 2_048_000}, "diloco": {"eval_loss": diloco}}


def study(row: str, seed: int, loss: float, size: str = "medium") -> dict:
    return {"size": size, "row": row, "seed": seed, "eval_loss": loss, "stage": "study", "tokens": 1_024_000,
            "inner_lr": 4e-3 if row == "dp" else 2e-3, "outer_lr": 0.7, "outer_momentum": 0.7}


def test_gaps_are_per_seed_and_grouped_by_setting():
    records = [hf(0, 2.0, 2.1), hf(1, 2.0, 2.04), hf(0, 2.0, 2.2, lr=3e-3), titan(1.5, 1.53), titan(1.5, 1.56, 1.0)]
    gaps = gap.ecosystem_gaps(records)
    assert len(gaps) == 4
    by_bench = {(s.bench, s.dp_lr): g for s, g in gaps.items() if s.outer_lr != 1.0}
    assert [g for s, g in gaps.items() if s.outer_lr == 1.0] == [{0: pytest.approx(4.0)}]  # another outer step
    assert by_bench[("hf", 1.5e-3)] == {0: pytest.approx(5.0), 1: pytest.approx(2.0)}
    assert by_bench[("hf", 3e-3)] == {0: pytest.approx(10.0)}
    assert by_bench[("titan", 1.6e-3)] == {0: pytest.approx(2.0)}  # no seed (titan.py before --seed): 0


def test_a_diverged_run_is_shown_as_such_not_dropped_or_averaged():
    gaps = gap.ecosystem_gaps([hf(0, 2.0, float("nan")), hf(1, 2.0, 2.02)])
    (only,) = gaps.values()
    assert math.isnan(only[0]) and only[1] == pytest.approx(1.0)
    conv = [study("dp", 1, 2.0), study("m2-h25-outer", 1, 2.1)]
    line = next(x for x in gap.table(conv, {"hf": [hf(0, 2.0, float("nan")), hf(1, 2.0, 2.02)]}).splitlines()
                if x.startswith("| hf"))
    assert "diverged / +1.00 | — | —" in line and line.endswith("| — | — |")


def test_two_runs_of_one_setting_and_seed_are_an_error_not_a_silent_choice():
    with pytest.raises(ValueError, match="second run of the same setting and seed 1"):
        gap.ecosystem_gaps([hf(1, 2.0, 2.1), hf(1, 2.0, 2.2)])
    twice = [study("dp", 1, 2.0), study("m2-h25-outer", 1, 2.1), study("m2-h25-outer", 1, 3.0)]
    with pytest.raises(ValueError, match="two records of one seed"):
        gap.study_gap(twice, "medium", "m2-h25-outer")


def test_a_record_without_a_field_names_it():
    broken = hf(0, 2.0, 2.1)
    del broken["dp"]["tokens"]
    with pytest.raises(ValueError, match=r"record 1 \(hf\): no dp.tokens"):
        gap.ecosystem_gaps([hf(1, 2.0, 2.1), broken])
    with pytest.raises(ValueError, match="are not losses"):
        gap.ecosystem_gaps([hf(0, 0.0, 2.1)])


def test_the_study_rows_match_steps_and_h():
    s = gap.setting_of(hf(0, 2.0, 2.1))
    assert gap.study_match(s) == ("medium", ("m2-h25-outer", "m2-h25-lr0.7-mom0.5", "m2-h25-lr0.7-mom0.3"))
    size, rows = gap.study_match(gap.setting_of(titan(1.5, 1.53)))
    assert size == "medium-long" and rows[0] == "m2-h20-outer" and all(r.startswith("m2-h20-") for r in rows)
    assert gap.study_match(gap.setting_of(hf(0, 2.0, 2.1, h=50))) is None
    assert gap.study_match(gap.setting_of(hf(0, 2.0, 2.1, steps=1000))) is None


def test_the_study_gap_pairs_on_the_seeds_both_rows_have():
    conv = [study("dp", 1, 2.0), study("dp", 2, 2.0), study("m2-h25-outer", 1, 2.1), study("m2-h25-outer", 2, 2.2),
            study("m2-h25-outer", 3, 9.9)]
    p = gap.study_gap(conv, "medium", "m2-h25-outer")
    assert p.diffs == pytest.approx((5.0, 10.0)) and p.mean == pytest.approx(7.5)
    assert gap.study_gap([study("m2-h25-outer", 1, 2.1)], "medium", "m2-h25-outer") is None


ROWS = ("m2-h25-outer", "m2-h25-lr0.7-mom0.5", "m2-h25-lr0.7-mom0.3")


def test_the_studys_gap_is_its_best_outer_step_on_the_seeds_its_rows_share():
    conv = [study("dp", s, 2.0) for s in (1, 2, 3)]
    conv += [study(ROWS[0], s, x) for s, x in ((1, 2.1), (2, 2.2), (3, 2.12))]  # +5, +10, +6: mean 7
    conv += [study(ROWS[1], s, x) for s, x in ((1, 2.08), (2, 2.16), (3, 2.14))]  # +4, +8, +7: mean 6.33
    row, p = gap.study_best(conv, "medium", ROWS[:2])
    assert row == ROWS[1] and p.n == 3 and p.mean == pytest.approx(19 / 3)
    # a row on fewer seeds is compared on the seeds it shares: +5.5 on seeds 1-2 beats 7.5 and 6 there, and
    # is reported on its own seeds; a row worse on every shared seed is not chosen for having more of them
    two = conv + [study(ROWS[2], s, 2.11) for s in (1, 2)]
    row, p = gap.study_best(two, "medium", ROWS)
    assert row == ROWS[2] and p.n == 2 and p.mean == pytest.approx(5.5)
    worse = conv + [study(ROWS[2], s, x) for s, x in ((1, 2.2), (2, 2.4))]
    assert gap.study_best(worse, "medium", ROWS)[0] == ROWS[1]
    assert gap.study_best([study("dp", 1, 2.0)], "medium", ROWS) is None
    line = next(x for x in gap.table(worse, {"hf": [hf(0, 2.0, 2.04)]}).splitlines() if x.startswith("| hf"))
    assert f"{ROWS[1]} (medium)" in line and "**+6.33**" in line
    assert line.endswith(f"| {ROWS[0]} +7.00 (1-3); {ROWS[2]} +15.00 (1, 2) |")


def test_a_tie_goes_to_the_tuned_outer_step():
    conv = [study("dp", 1, 2.0), study(ROWS[1], 1, 2.1), study(ROWS[0], 1, 2.1)]
    assert gap.study_best(conv, "medium", ROWS)[0] == ROWS[0]


def test_a_study_seed_that_diverged_or_was_not_paired_is_named_not_dropped():
    conv = [study("dp", s, 2.0) for s in (1, 2, 3)]
    conv += [study(ROWS[0], 1, 2.1), study(ROWS[0], 2, 2.2), study(ROWS[0], 3, float("nan"))]
    conv += [study(ROWS[1], s, float("inf")) for s in (1, 2)] + [study(ROWS[2], 7, 2.0)]
    assert gap.study_diverged(conv, "medium", ROWS[0]) == [3]
    line = next(x for x in gap.table(conv, {"hf": [hf(0, 2.0, 2.04)]}).splitlines() if x.startswith("| hf"))
    assert f"{ROWS[0]} (medium)" in line and "| 1, 2; 3 diverged |" in line
    assert f"{ROWS[1]} — (1, 2 diverged; no seed paired with dp: 1, 2 run)" in line
    assert f"{ROWS[2]} — (no seed paired with dp: 7 run)" in line


def test_a_malformed_study_record_is_named():
    bad = study(ROWS[0], 1, 2.1)
    bad["eval_loss"] = None
    with pytest.raises(ValueError, match=r"convergence record 1 \(m2-h25-outer\): eval_loss is None"):
        gap.table([study("dp", 1, 2.0), bad], {"hf": [hf(0, 2.0, 2.04)]})
    nameless = study("dp", 1, 2.0)
    del nameless["size"]
    with pytest.raises(ValueError, match="size is None"):
        gap.table([nameless], {})
    no_outer = study(ROWS[0], 1, 2.1)
    no_outer["outer_momentum"] = None
    with pytest.raises(ValueError, match="must be numbers"):
        gap.table([study("dp", 1, 2.0), no_outer], {"hf": [hf(0, 2.0, 2.04)]})


def test_welch_interval_by_hand():
    a, b = report.paired_stats([1.0, 3.0]), report.paired_stats([0.0, 2.0])
    # variances 2 and 2, se = sqrt(2/2 + 2/2) = sqrt(2), dof = 2^2 / (1 + 1) = 2, t = 4.3027
    low, high = gap.welch_interval(a, b)
    assert low == pytest.approx(1.0 - 4.3027 * 2 ** 0.5, abs=1e-3)
    assert high == pytest.approx(1.0 + 4.3027 * 2 ** 0.5, abs=1e-3)
    assert gap.welch_interval(a, report.paired_stats([1.0])) is None
    # unequal sizes and variances, where a pooled t and a rounded dof differ: a = 0, 2, 4, 6 (mean 3, var 20/3),
    # b = 1, 1.5, 2 (mean 1.5, var 0.25); va = 5/3, vb = 1/12, se = sqrt(1.75), dof = 1.75^2 / ((5/3)^2 / 3 +
    # (1/12)^2 / 2) = 3.27 -> 3, t = 3.1824
    low, high = gap.welch_interval(report.paired_stats([0.0, 2.0, 4.0, 6.0]), report.paired_stats([1.0, 1.5, 2.0]))
    assert low == pytest.approx(1.5 - 3.1824 * 1.75 ** 0.5, abs=1e-3)
    assert high == pytest.approx(1.5 + 3.1824 * 1.75 ** 0.5, abs=1e-3)


def test_the_table_says_where_the_study_has_no_row_and_gives_the_difference_where_it_has():
    conv = [study("dp", s, 2.0) for s in (1, 2)] + [study("m2-h25-outer", 1, 2.1), study("m2-h25-outer", 2, 2.2)]
    text = gap.table(conv, {"hf": [hf(0, 2.0, 2.04), hf(1, 2.0, 2.08), hf(0, 2.0, 2.1, h=50)]})
    lines = text.splitlines()
    matched = next(x for x in lines if "| 25 |" in x)
    assert "m2-h25-outer (medium)" in matched and "**+3.00**" in matched and "**+7.50**" in matched
    # 3.00 − 7.50; both sides n = 2, variances 2 and 12.5: se = sqrt(7.25), dof = 7.25^2 / (1 + 6.25^2) = 1.31 -> 1
    half = 12.7062 * 7.25 ** 0.5
    assert f"−4.50 ({-4.5 - half:+.2f} .. {-4.5 + half:+.2f})".replace("-", "−") in matched
    assert "1,024,000 tokens, inner lr 0.004 / 0.002, outer 0.7 / 0.7" in matched
    assert "none at 500 steps, H=50" in next(x for x in lines if "| 50 |" in x)
    no_study = gap.table([], {"hf": [hf(0, 2.0, 2.04)]})
    assert "| not run |" in no_study
