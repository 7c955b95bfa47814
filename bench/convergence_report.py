"""The convergence study's report (`bench/convergence.py` runs the study): the markdown table
against the data-parallel baseline, the paired table against the best fp32 DiLoCo (each seed
against the same seed, a mean and a 95 % Student-t interval), QSR against the fixed H it matches,
and the loss curves' PNG. Pure functions of the JSON records, so `python bench/convergence.py
--table` (or `--paired`) reports a file without running anything.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.convergence_rows import SIZES, study_rows, sweep_rows


def mean_loss(records: list[dict], size: str, row: str) -> float | None:
    """Mean eval loss over the seeds of (size, row) with a finite loss; None if there are none."""
    vals = [r["eval_loss"] for r in records if r["size"] == size and r["row"] == row and math.isfinite(r["eval_loss"])]
    return statistics.fmean(vals) if vals else None


def dp_reference(records: list[dict], size: str) -> float | None:
    """The baseline every row is compared with: the data-parallel study row of ``size`` with the
    lowest mean eval loss over its seeds (a tuned DP is the best DP that was run)."""
    names = {r["row"] for r in records if r["size"] == size and r["stage"] == "study" and r["mode"] == "dp"}
    losses = [x for x in (mean_loss(records, size, n) for n in names) if x is not None]
    return min(losses) if losses else None


def table(records: list[dict], stage: str = "study") -> str:
    """Markdown: one line per (size, row), eval loss as mean ± sd over seeds, vs the dp baseline;
    bits per parameter per inner step per sending group (the records' all-groups figure / G)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["stage"] == stage:
            groups.setdefault((r["size"], r["row"]), []).append(r)
    order = {n: i for i, n in enumerate([r.name for r in study_rows()] + [r.name for r in sweep_rows()])}
    lines = ["| size | row | mode | M | H | P | τ | codec | inner lr | outer lr/mom | seeds | eval loss | vs dp | "
             "MB sent | syncs | bits/param/step per group |", "|" + "---|" * 16]
    for (size, row), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "small", order.get(kv[0][1], 99))):
        r = rs[0]
        losses = [x["eval_loss"] for x in rs]
        mean = statistics.fmean(losses)
        sd = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
        ref = dp_reference(records, size)
        vs = "—" if r["mode"] == "dp" or not ref else f"{100 * (mean / ref - 1):+.2f}%"
        h = "qsr " + str(r["h"]) if r["schedule"] == "qsr" else r["h"]
        outer = "—" if r["outer_lr"] is None else f"{r['outer_lr']:g}/{r['outer_momentum']:g}"
        lines.append(
            f"| {size} | {row} | {r['mode']} | {r['groups']} | {h} | {r['fragments']} | {r['overlap_steps']} | "
            f"{r['codec']} | {r['inner_lr']:g} | {outer} | {len(rs)} | {mean:.4f}{sd} | {vs} | "
            f"{statistics.fmean(x['bytes_sent'] for x in rs) / 1e6:.2f} | {r['syncs']} | "
            f"{statistics.fmean(x['bits_per_param_per_step'] / x['groups'] for x in rs):.3g} |")
    return "\n".join(lines)


# --- paired comparisons against the best fp32 DiLoCo ------------------------------------------------

#: the modes that are DiLoCo itself (blocking, its fragments, Streaming DiLoCo's overlap); eager,
#: delayed and CO2 are other algorithms, data parallel the other baseline
DILOCO_MODES = ("blocking", "overlap")


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
                    -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, dof: int) -> float:
    """P(T <= t) for Student's t with ``dof`` degrees of freedom."""
    tail = 0.5 * _betainc(dof / 2.0, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile of Student's t with ``dof`` >= 1 degrees of freedom (bisection on
    ``t_cdf`` to 1e-12; scipy is not a dependency). t_quantile(0.975, 4) = 2.7764."""
    if not 0.0 < p < 1.0 or dof < 1:
        raise ValueError(f"need 0 < p < 1 and dof >= 1, got p={p}, dof={dof}")
    if p < 0.5:
        return -t_quantile(1.0 - p, dof)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, dof) < p:
        hi *= 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, dof) < p else (lo, mid)
    return (lo + hi) / 2.0


@dataclass(frozen=True)
class Paired:
    """Per-seed % differences of one row against its reference, their mean and, for n >= 2,
    the two-sided Student-t interval (n - 1 degrees of freedom) of the mean difference."""

    diffs: tuple[float, ...]
    mean: float
    low: float | None
    high: float | None
    t: float | None

    @property
    def n(self) -> int:
        return len(self.diffs)


def paired_stats(diffs: list[float], level: float = 0.95) -> Paired:
    """Mean of ``diffs`` and its two-sided ``level`` interval, mean ± t_{(1+level)/2, n-1} sd / √n
    (no interval for a single value)."""
    if not diffs:
        raise ValueError("no differences to pair")
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return Paired(tuple(diffs), mean, None, None, None)
    t = t_quantile((1.0 + level) / 2.0, len(diffs) - 1)
    half = t * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return Paired(tuple(diffs), mean, mean - half, mean + half, t)


def seed_losses(records: list[dict], size: str, row: str, stage: str = "study") -> dict[int, float]:
    """{seed: eval loss} of (size, row) in ``stage``, finite losses only."""
    return {r["seed"]: r["eval_loss"] for r in records
            if r["size"] == size and r["row"] == row and r["stage"] == stage and math.isfinite(r["eval_loss"])}


def is_fp32_diloco(rec: dict) -> bool:
    """A DiLoCo row (blocking or overlapped, any H, schedule or outer step) that sends fp32."""
    return rec["mode"] in DILOCO_MODES and rec["codec"] == "fp32" and rec.get("outer_rule") != "sparseloco"


@dataclass(frozen=True)
class Reference:
    """The row a row is paired with, the seeds they share (and the row's seeds it lacks), and
    how many fp32 DiLoCo rows the reference was the best of."""

    row: str
    seeds: tuple[int, ...]
    missing: tuple[int, ...]
    candidates: int


def best_fp32_reference(records: list[dict], size: str, row: str, stage: str = "study") -> Reference | None:
    """The reference of (size, row): of the fp32 DiLoCo rows of that size, stage and number of
    groups M, those that share the most of this row's seeds; of them, the one with the lowest mean
    eval loss over the shared seeds (ties: the first name). The row itself is a candidate (an fp32
    row that is the best is its own reference). Picking the lowest of several references, each
    noisy, is itself a selection: the reference is biased low (against the row). None if no fp32
    DiLoCo row shares a seed."""
    mine = seed_losses(records, size, row, stage)
    rec = next((r for r in records if r["size"] == size and r["row"] == row and r["stage"] == stage), None)
    if not mine or rec is None:
        return None
    names = sorted({r["row"] for r in records if r["size"] == size and r["stage"] == stage
                    and r["groups"] == rec["groups"] and is_fp32_diloco(r)})
    shared = {n: sorted(set(mine) & set(seed_losses(records, size, n, stage))) for n in names}
    shared = {n: s for n, s in shared.items() if s}
    if not shared:
        return None
    most = max(len(s) for s in shared.values())
    tied = [n for n, s in shared.items() if len(s) == most]

    def mean_on_shared(n: str) -> float:
        losses = seed_losses(records, size, n, stage)
        return statistics.fmean(losses[s] for s in shared[n])

    best = min(tied, key=lambda n: (mean_on_shared(n), n))
    return Reference(best, tuple(shared[best]), tuple(sorted(set(mine) - set(shared[best]))), len(tied))


def paired_against(records: list[dict], size: str, row: str, ref: str, seeds: tuple[int, ...] | list[int],
                   stage: str = "study", level: float = 0.95) -> Paired:
    """(size, row) against (size, ref) on ``seeds``: 100 (loss / ref's loss on the same seed − 1)."""
    mine, theirs = seed_losses(records, size, row, stage), seed_losses(records, size, ref, stage)
    return paired_stats([100.0 * (mine[s] / theirs[s] - 1.0) for s in seeds], level)


def _size_order(size: str) -> tuple:
    order = {name: i for i, name in enumerate(SIZES)}
    return (order.get(size, 99), size)


def signed_pct(x: float) -> str:
    return f"{x:+.2f}".replace("-", "−")


def seed_span(seeds) -> str:
    s = list(seeds)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}-{s[-1]}"
    return ", ".join(map(str, s))


def named_reference(records: list[dict], size: str, row: str, against: str, stage: str = "study") -> Reference | None:
    """``against`` as the reference of (size, row), on the seeds both have; None if they share none."""
    mine, theirs = seed_losses(records, size, row, stage), seed_losses(records, size, against, stage)
    shared = sorted(set(mine) & set(theirs))
    return Reference(against, tuple(shared), tuple(sorted(set(mine) - set(theirs))), 1) if shared else None


def paired_table(records: list[dict], stage: str = "study", level: float = 0.95, against: str | None = None) -> str:
    """Markdown: every (size, row) of ``stage`` against its best fp32 DiLoCo reference
    (``best_fp32_reference``), or against the row ``against`` of its size where given (sizes
    without it are left out): per-seed % differences, their mean and the ``level`` Student-t
    interval; a row the reference lacks seeds of is paired on the shared seeds and says which
    were left out. Per size, in the study's order."""
    order = {n: i for i, n in enumerate([r.name for r in study_rows()] + [r.name for r in sweep_rows()])}
    keys = sorted({(r["size"], r["row"]) for r in records if r["stage"] == stage},
                  key=lambda k: (_size_order(k[0]), order.get(k[1], 99), k[1]))
    pct = f"{100 * level:g} %"
    lines = [f"| size | row | M | codec | reference (best of K fp32 DiLoCo rows on these seeds) | seeds | "
             f"per seed, % vs reference | paired mean | {pct} interval (Student t, n−1 dof) | n |",
             "|" + "---|" * 10]
    if against is not None:
        keys = [k for k in keys if seed_losses(records, k[0], against, stage)]
    for size, row in keys:
        ref = (best_fp32_reference(records, size, row, stage) if against is None
               else named_reference(records, size, row, against, stage))
        rec = next(r for r in records if r["size"] == size and r["row"] == row and r["stage"] == stage)
        head = f"| {size} | {row} | {rec['groups']} | {rec['codec']} |"
        if ref is None and against is not None:
            lines.append(f"{head} {against} shares no seed | {seed_span(sorted(seed_losses(records, size, row, stage)))} "
                         f"| — | — | — | 0 |")
            continue
        if ref is None:
            seeds = sorted(seed_losses(records, size, row, stage))
            lines.append(f"{head} none (no fp32 DiLoCo row with M={rec['groups']} on these seeds) | "
                         f"{seed_span(seeds)} | — | — | — | {len(seeds)} |")
            continue
        left = f"; seeds {seed_span(ref.missing)} not paired (reference lacks them)" if ref.missing else ""
        who = f"{ref.row} ({'named' if against else f'best of {ref.candidates}'}{left})"
        if ref.row == row:
            lines.append(f"{head} **this row** ({'named' if against else f'best of {ref.candidates}'}{left}) | "
                         f"{seed_span(ref.seeds)} | — | "
                         f"reference | — | {len(ref.seeds)} |")
            continue
        p = paired_against(records, size, row, ref.row, ref.seeds, stage, level)
        ci = "— (one seed)" if p.low is None else f"{signed_pct(p.low)} .. {signed_pct(p.high)}"
        lines.append(f"{head} {who} | {seed_span(ref.seeds)} | {' / '.join(signed_pct(d) for d in p.diffs)} | "
                     f"**{signed_pct(p.mean)}** | {ci} | {p.n} |")
    return "\n".join(lines)


def qsr_report(records: list[dict]) -> list[str]:
    """Each QSR row against the fixed H (same M, fp32, same outer settings: ``qsr`` against
    ``m{M}-h{H}``, ``qsr-outer`` against ``m{M}-h{H}-outer``) whose loss it matches: of the fixed-H
    rows QSR is at least as good as (mean eval loss at least QSR's), the one with the fewest syncs;
    syncs saved = its syncs minus QSR's (negative: QSR needed more)."""
    out = []
    for size in sorted({r["size"] for r in records}):
        for qname, suffix in (("qsr", ""), ("qsr-outer", "-outer")):
            q = mean_loss(records, size, qname)
            qrec = next((r for r in records if r["size"] == size and r["row"] == qname), None)
            if q is None or qrec is None:
                continue
            fixed = []
            for h in (10, 30, 100):
                name = f"m{qrec['groups']}-h{h}{suffix}"
                loss = mean_loss(records, size, name)
                rec = next((r for r in records if r["size"] == size and r["row"] == name), None)
                if loss is not None:
                    fixed.append((rec["syncs"], h, loss))
            head = f"{size}: {qname} eval {q:.4f} with {qrec['syncs']} syncs"
            match = [f for f in fixed if f[2] >= q]
            if match:
                syncs, h, loss = min(match)
                saved = syncs - qrec["syncs"]
                verdict = (f"{saved} syncs saved ({100 * saved / syncs:.0f}%)" if saved >= 0
                           else f"QSR needs {-saved} more syncs")
                out.append(f"{head}; fixed H={h} reaches {loss:.4f} with {syncs} syncs: {verdict}"
                           + "".join(f"; H={hh}: {ll:.4f} ({100 * (q / ll - 1):+.2f}% for QSR) with {ss} syncs"
                                     for ss, hh, ll in sorted(fixed) if hh != h))
            elif fixed:
                syncs, h, loss = min(fixed, key=lambda f: f[2])
                out.append(f"{head} is worse than every fixed H; the best, H={h}, reaches {loss:.4f} "
                           f"({100 * (q / loss - 1):+.2f}%) with {syncs} syncs")
    return out


PLOT_ROWS = ("dp", "m1-h30-outer", "m2-h30-outer", "m4-h30-outer", "m2-h30", "m2-h100-outer", "m2-h30-int4-outer",
             "m2-h30-fp4-e2m1-outer", "overlap-p2-tau5-fp4", "m2-h30-sign1-outer", "eager", "co2", "qsr-outer")


def plot(records: list[dict], path: Path) -> bool:
    """Loss against tokens and against bytes, one panel pair per size (first seed of each row)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[dev]'): no PNG written", file=sys.stderr)
        return False
    order = {name: i for i, name in enumerate(SIZES)}
    sizes = sorted({r["size"] for r in records if r["stage"] == "study"}, key=lambda s: (order.get(s, 99), s))
    if not sizes:
        return False
    fig, axes = plt.subplots(len(sizes), 2, figsize=(12, 4.2 * len(sizes)), squeeze=False)
    palette = plt.get_cmap("tab10").colors
    styles = {name: dict(lw=1.3, color=palette[i % 10], ls="-" if i < 10 else "--")
              for i, name in enumerate(n for n in PLOT_ROWS if n != "dp")}
    styles["dp"] = dict(lw=2.2, color="black")
    for row_axes, size in zip(axes, sizes):
        shown = {}
        for r in sorted((r for r in records if r["size"] == size and r["stage"] == "study"), key=lambda r: r["seed"]):
            if r["row"] in PLOT_ROWS and r["row"] not in shown:
                shown[r["row"]] = r
        for name in PLOT_ROWS:
            r = shown.get(name)
            if r is None:
                continue
            pts = [p for p in r["curve"] if p["step"] > 0]
            style = styles[name]
            row_axes[0].plot([p["tokens"] / 1e6 for p in pts], [p["eval_loss"] for p in pts], label=name, **style)
            pts_b = [p for p in pts if p["bytes"] > 0]
            if pts_b:
                row_axes[1].plot([p["bytes"] / 1e6 for p in pts_b], [p["eval_loss"] for p in pts_b], label=name, **style)
        finals = [r["eval_loss"] for r in shown.values() if math.isfinite(r["eval_loss"])]
        if finals:  # the first points (and spikes) far above the end would flatten what matters
            for ax in row_axes:
                ax.set_ylim(min(finals) - 0.05, 1.5 * min(finals))
        n = next(iter(shown.values()))["num_parameters"] if shown else 0
        row_axes[0].set(xlabel="tokens (M)", ylabel="eval loss (nats/token)", title=f"{size} ({n:,} parameters)")
        row_axes[1].set(xlabel="MB sent between groups (log)", ylabel="eval loss", xscale="log",
                        title=f"{size}: loss against bytes")
        for ax in row_axes:
            ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize=7, ncol=2)
        row_axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
