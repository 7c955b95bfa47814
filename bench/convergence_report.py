"""The convergence study's report (`bench/convergence.py` runs the study): the markdown table
against the data-parallel baseline, QSR against the fixed H it matches, and the loss curves' PNG.
Pure functions of the JSON records, so `python bench/convergence.py --table` reports a file
without running anything.
"""

from __future__ import annotations

import math
import statistics
import sys
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
    """Markdown: one line per (size, row), eval loss as mean ± sd over seeds, vs the dp baseline."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["stage"] == stage:
            groups.setdefault((r["size"], r["row"]), []).append(r)
    order = {n: i for i, n in enumerate([r.name for r in study_rows()] + [r.name for r in sweep_rows()])}
    lines = ["| size | row | mode | M | H | P | τ | codec | inner lr | outer lr/mom | seeds | eval loss | vs dp | "
             "MB sent | syncs | bits/param/step |", "|" + "---|" * 16]
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
            f"{statistics.fmean(x['bits_per_param_per_step'] for x in rs):.3g} |")
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
