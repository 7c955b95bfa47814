"""The ecosystem benchmarks' gap to their own data parallel beside the convergence study's gap at the
same H and number of rounds (issue 52's target: "eval loss within the convergence study's DiLoCo gap").

DiLoCo's gap to data parallel is not one number: in the study it falls with the number of outer rounds
(the 834k GPT, fp32 H=30: +6.4 % at 17 rounds, +1.0 % at 267). So each setting of ``bench/hf.py`` and
``bench/titan.py`` (steps, H, inner lrs, outer step) is set beside the study's own model run at the same
steps and H (``ECOSYSTEM_ROWS``: ``m2-h{H}-outer`` and the same H at lower outer momenta, against ``dp`` of
the size with those steps), both as per-seed gaps (DiLoCo / DP − 1 on the same seed), their mean and 95 %
Student-t interval. The study's gap is its best outer step's at that H (the lowest mean on the seeds
its rows share); the others are shown beside it, and a study seed that diverged is named, not dropped.

    python bench/ecosystem_gap.py          # the table of bench/pages/hf.md and bench/pages/titan.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
if str(ROOT) not in sys.path:  # not bench/ itself: its transport.py would shadow the package
    sys.path.insert(0, str(ROOT))

from bench.convergence_report import (  # noqa: E402
    Paired,
    paired_against,
    paired_stats,
    seed_losses,
    seed_span,
    signed_pct,
    t_quantile,
)
from bench.convergence_rows import ECOSYSTEM_ROWS, SIZES, study_rows  # noqa: E402


@dataclass(frozen=True)
class Setting:
    """What makes two runs of one ecosystem benchmark repeats of each other (all but the seed)."""

    bench: str
    steps: int
    h: int
    dp_lr: float
    diloco_lr: float
    outer_lr: float | None  # None: the engine's default
    outer_momentum: float | None  # None: the engine's default
    tokens: int  # in each run, all groups together

    @property
    def rounds(self) -> int:
        return self.steps // self.h


def _field(rec: dict, index: int, *path: str):
    value = rec
    for key in path:
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"record {index} ({rec.get('bench', '?')}): no {'.'.join(path)}")
        value = value[key]
    return value


def setting_of(rec: dict, index: int = 0) -> Setting:
    """The setting of one ``bench/hf.py`` or ``bench/titan.py`` record (``index``: its place in its file,
    for the error a record without a field raises)."""
    def lr(side: str, flat: str) -> float:
        return _field(rec, index, side, "inner_lr") if "inner_lr" in rec.get(side, {}) else _field(rec, index, flat)

    return Setting(_field(rec, index, "bench"), _field(rec, index, "steps"), _field(rec, index, "h"),
                   lr("dp", "dp_lr"), lr("diloco", "lr"), rec.get("outer_lr"), rec.get("outer_momentum"),
                   _field(rec, index, "dp", "tokens"))


def ecosystem_gaps(records: list[dict]) -> dict[Setting, dict[int, float]]:
    """{setting: {seed: % gap of DiLoCo's eval loss over data parallel's}}; a record without a seed
    (``bench/titan.py`` before its ``--seed``, whose seed was 0) counts as seed 0; a run with a non-finite
    loss counts as nan (shown, not dropped). Two records of one setting and seed are an error: which one
    is meant?"""
    out: dict[Setting, dict[int, float]] = {}
    for i, rec in enumerate(records):
        dp, dl = _field(rec, i, "dp", "eval_loss"), _field(rec, i, "diloco", "eval_loss")
        if not all(isinstance(x, (int, float)) for x in (dp, dl)) or dp <= 0:
            raise ValueError(f"record {i} ({rec.get('bench', '?')}): eval losses {dp!r} / {dl!r} are not losses")
        seeds = out.setdefault(setting_of(rec, i), {})
        seed = rec.get("seed", 0)
        if seed in seeds:
            raise ValueError(f"record {i} ({rec['bench']}): a second run of the same setting and seed {seed}")
        seeds[seed] = 100.0 * (dl / dp - 1.0) if math.isfinite(dp) and math.isfinite(dl) else math.nan
    return out


def study_match(setting: Setting) -> tuple[str, tuple[str, ...]] | None:
    """(size, rows) of the convergence study at the setting's steps and H (one row per outer step), or
    None if the study has none."""
    rows = {r.name: r for r in study_rows()}
    for size, names in ECOSYSTEM_ROWS.items():
        if SIZES[size].steps == setting.steps and all(rows[name].h == setting.h for name in names):
            return size, names
    return None


def _study_records(conv: list[dict], size: str, row: str) -> list[dict]:
    return [r for r in conv if r.get("size") == size and r.get("row") == row and r.get("stage") == "study"]


def study_seeds(conv: list[dict], size: str, row: str) -> list[int]:
    """The seeds the study's (size, row) and (size, dp) both have, finite losses only; an error if
    either has two records of one seed."""
    for name in (row, "dp"):
        seeds = [r["seed"] for r in _study_records(conv, size, name)]
        if len(seeds) != len(set(seeds)):
            raise ValueError(f"the study's {size} {name} has two records of one seed: {sorted(seeds)}")
    return sorted(set(seed_losses(conv, size, row)) & set(seed_losses(conv, size, "dp")))


def study_gap(conv: list[dict], size: str, row: str) -> Paired | None:
    """The study's (size, row) against its ``dp`` row on the seeds both have; None if they share none."""
    seeds = study_seeds(conv, size, row)
    return paired_against(conv, size, row, "dp", seeds) if seeds else None


def study_best(conv: list[dict], size: str, rows: tuple[str, ...]) -> tuple[str, Paired] | None:
    """The study's best DiLoCo among ``rows`` of ``size``: (row, its gap to ``dp`` on all its seeds), the
    row of the lowest mean gap on the seeds all rows paired with ``dp`` share (on each row's own seeds
    if they share none); a tie goes to the first of ``rows`` (the tuned outer step). None if no row
    shares a seed with ``dp``."""
    seeds = {row: study_seeds(conv, size, row) for row in rows}
    run = [row for row in rows if seeds[row]]
    if not run:
        return None
    shared = sorted(set.intersection(*(set(seeds[row]) for row in run)))
    best = min(run, key=lambda row: paired_against(conv, size, row, "dp", shared or seeds[row]).mean)
    return best, paired_against(conv, size, best, "dp", seeds[best])


def study_diverged(conv: list[dict], size: str, row: str) -> list[int]:
    """The seeds of the study's (size, row) whose eval loss is not finite (left out of its gap)."""
    return sorted(r["seed"] for r in _study_records(conv, size, row) if not math.isfinite(r["eval_loss"]))


def check_study_records(conv: list[dict]) -> None:
    """ValueError naming the first study record without a size, a row, an integer seed or a numeric eval
    loss (what pairing reads)."""
    for i, r in enumerate(conv):
        if r.get("stage") != "study":
            continue
        for key, kind in (("size", str), ("row", str), ("seed", int), ("eval_loss", (int, float))):
            if not isinstance(r.get(key), kind) or isinstance(r.get(key), bool):
                raise ValueError(f"convergence record {i} ({r.get('row', '?')}): {key} is {r.get(key)!r}")


def study_setting(conv: list[dict], size: str, row: str) -> str:
    """The study row's tokens, inner lrs and outer step, as its records give them (they differ from
    the ecosystem run's: the match is by steps and H)."""
    mine, dp = _study_records(conv, size, row), _study_records(conv, size, "dp")
    if not mine or not dp:
        return "—"
    mine, dp = mine[0], dp[0]
    for rec, keys in ((mine, ("tokens", "inner_lr", "outer_lr", "outer_momentum")), (dp, ("inner_lr",))):
        if not all(isinstance(rec.get(k), (int, float)) for k in keys):
            raise ValueError(f"the study's {size} {rec['row']}: {', '.join(keys)} must be numbers: "
                             f"{ {k: rec.get(k) for k in keys} }")
    return (f"{mine['tokens']:,} tokens, inner lr {dp['inner_lr']:g} / {mine['inner_lr']:g}, "
            f"outer {mine['outer_lr']:g} / {mine['outer_momentum']:g}")


def welch_interval(a: Paired, b: Paired, level: float = 0.95) -> tuple[float, float] | None:
    """The ``level`` interval of mean(a) − mean(b) for two independent samples (Welch; degrees of
    freedom rounded down, which widens it); None unless both have at least two values."""
    if a.n < 2 or b.n < 2:
        return None
    va, vb = statistics.variance(a.diffs) / a.n, statistics.variance(b.diffs) / b.n
    se = math.sqrt(va + vb)
    if se == 0.0:
        return (a.mean - b.mean, a.mean - b.mean)
    dof = max(1, int((va + vb) ** 2 / (va ** 2 / (a.n - 1) + vb ** 2 / (b.n - 1))))
    half = t_quantile((1.0 + level) / 2.0, dof) * se
    return (a.mean - b.mean - half, a.mean - b.mean + half)


def _outer(s: Setting) -> str:
    lr = "default" if s.outer_lr is None else f"{s.outer_lr:g}"
    return f"{lr} / {'default' if s.outer_momentum is None else f'{s.outer_momentum:g}'}"


def _study_seeds_note(conv: list[dict], size: str, row: str) -> str:
    paired, diverged = study_seeds(conv, size, row), study_diverged(conv, size, row)
    notes = ([seed_span(paired)] if paired else []) + ([f"{seed_span(diverged)} diverged"] if diverged else [])
    return "; ".join(notes)


def _others(conv: list[dict], size: str, rows: tuple[str, ...], best: str) -> str:
    out = []
    for row in rows:
        if row == best:
            continue
        p = study_gap(conv, size, row)
        ran = _study_records(conv, size, row)
        if p is not None:
            out.append(f"{row} {signed_pct(p.mean)} ({_study_seeds_note(conv, size, row)})")
        elif ran:
            note = _study_seeds_note(conv, size, row)
            out.append(f"{row} — ({note + '; ' if note else ''}no seed paired with dp: "
                       f"{seed_span(sorted(r['seed'] for r in ran))} run)")
    return "; ".join(out) or "—"


def _summary(p: Paired) -> str:
    if any(math.isnan(d) for d in p.diffs):
        return f"{' / '.join('diverged' if math.isnan(d) else signed_pct(d) for d in p.diffs)} | — | —"
    per_seed = " / ".join(signed_pct(d) for d in p.diffs)
    interval = "one seed" if p.low is None else f"{signed_pct(p.low)} .. {signed_pct(p.high)}"
    return f"{per_seed} | **{signed_pct(p.mean)}** | {interval}"


def table(conv: list[dict], benches: dict[str, list[dict]]) -> str:
    """Markdown: every setting of every ecosystem benchmark, its gap over seeds, and the study's gap at
    the same steps and H (or why there is none), with the difference of the two means."""
    lines = ["| bench | steps | H | rounds | inner lr DP / DiLoCo | outer lr / momentum | seeds | gap per seed, % | "
             "mean | 95 % interval | tokens | study's best row (size): its tokens, inner lr DP / DiLoCo, outer | "
             "study seeds | study gap per seed, % | study mean | study interval | difference of means (95 %, Welch) | "
             "the study's other outer steps: mean gap (seeds) |",
             "|" + "---|" * 18]
    check_study_records(conv)
    for bench, records in benches.items():
        for s, gaps in ecosystem_gaps(records).items():
            values = [gaps[k] for k in sorted(gaps)]
            eco = (Paired(tuple(values), math.nan, None, None, None) if any(math.isnan(v) for v in values)
                   else paired_stats(values))
            head = (f"| {bench} | {s.steps:,} | {s.h} | {s.rounds} | {s.dp_lr:g} / {s.diloco_lr:g} | {_outer(s)} | "
                    f"{seed_span(sorted(gaps))} | {_summary(eco)} | {s.tokens:,} |")
            match = study_match(s)
            best = study_best(conv, *match) if match else None
            if best is None:
                why = "not run" if match else f"none at {s.steps:,} steps, H={s.h}"
                lines.append(f"{head} {why} | — | — | — | — | — | — |")
                continue
            size, rows = match
            row, ref = best
            if math.isnan(eco.mean):
                d = "—"
            else:
                diff = welch_interval(eco, ref)
                d = signed_pct(eco.mean - ref.mean) + (f" ({signed_pct(diff[0])} .. {signed_pct(diff[1])})" if diff
                                                       else " (one side has one seed)")
            lines.append(f"{head} {row} ({size}): {study_setting(conv, size, row)} | "
                         f"{_study_seeds_note(conv, size, row)} | {_summary(ref)} | {d} | "
                         f"{_others(conv, size, rows, row)} |")
    return "\n".join(lines)


def _load(path: str, what: str) -> list[dict]:
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{what} records {path}: {e}") from None
    if not isinstance(records, list):
        raise SystemExit(f"{what} records {path}: not a JSON list")
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convergence", default=str(RESULTS / "convergence.json"))
    ap.add_argument("--hf", default=str(RESULTS / "hf.json"), help="bench/hf.py's records ('' to leave them out)")
    ap.add_argument("--titan", default=str(RESULTS / "titan.json"), help="bench/titan.py's ('' to leave them out)")
    a = ap.parse_args()
    conv = _load(a.convergence, "convergence")
    benches = {name: _load(path, name) for name, path in (("hf", a.hf), ("titan", a.titan)) if path}
    try:
        print(table(conv, benches))
    except ValueError as e:
        raise SystemExit(f"ecosystem_gap: {e}") from None


if __name__ == "__main__":
    main()
