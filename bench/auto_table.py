"""Writes ``diloco/job/auto_table.json``, the table ``--codec auto`` / ``--h auto`` choose from
(``diloco.job.auto_choice``), from the convergence study's records (``bench/results/convergence.json``).

Only rows the study measured at its long size (``small-xlong``, 8,000 steps) go in, and of those
only DiLoCo settings a job can run as one configuration planned before it starts: not data
parallel (``dp``), not QSR (its H follows the lr as it runs), not CO2 (its own outer knobs).
Each entry is a full setting (codec with its block size, top-k density and zstd stage, the last
exchange's codec, outer rule with its lr/momentum, SparseLoCo's beta or the residual's decay, H
and its schedule, fixed or paced with its gamma, mode, fragments, tau, overlap's merge alpha,
groups) with its eval loss, its loss cost against fp32 DiLoCo (``m{G}-h30-outer``: H=30, the
sweep's outer lr/momentum) paired by seed, and the bits all groups sent per parameter per inner step.

    python bench/auto_table.py            # rewrite the table
    python bench/auto_table.py --check    # exit 1 if the shipped table differs from a fresh one
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # not bench/ itself: its transport.py would shadow the package
    sys.path.insert(0, str(ROOT))

from bench.convergence_rows import study_rows
from diloco.job.auto_choice import CODEC_OPTIONS_SET, Setting

RESULTS = ROOT / "bench" / "results" / "convergence.json"
TABLE = ROOT / "diloco" / "job" / "auto_table.json"
SIZE = "small-xlong"
MODES = ("blocking", "overlap", "eager", "delayed")  # settings a job runs as one configuration
SCHEDULES = ("fixed", "paced")  # planned before the job starts (QSR's H follows the lr as it runs)
COMMAND = "python bench/auto_table.py"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _codec_options(row: Any, codec: str) -> dict[str, Any]:
    """The codec options a setting holds (``auto_choice.CODEC_OPTIONS_SET``, as the codec spec says),
    from the study's row: each under its own name, but the codec (the record's) and top-k's density
    (the row's ``density``; 0: the codec's 64 of 4096)."""
    known = {"codec": codec, "topk_density": (row.codec.topk_density or 64 / 4096) if codec == "topk" else 0.0}
    return {f.name: known[f.name] if f.name in known else getattr(row.codec, f.name) for f in CODEC_OPTIONS_SET}


def build(records: list[dict], source_sha256: str = "") -> dict:
    """The table (a dict ready for JSON) from the study's records: one entry per row of ``SIZE``."""
    rows = {r.name: r for r in study_rows()}
    by_row: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        if rec.get("size") == SIZE and rec.get("stage") == "study":
            by_row[rec["row"]].append(rec)
    entries = []
    for name, recs in sorted(by_row.items()):
        row = rows.get(name)
        first = recs[0]
        if row is None or first["mode"] not in MODES or first["schedule"] not in SCHEDULES or row.co2:
            continue
        if not all(r.get("params_identical", True) for r in recs):
            continue
        base = {r["seed"]: r["eval_loss"] for r in by_row.get(f"m{first['groups']}-h30-outer", [])}
        costs = [r["eval_loss"] / base[r["seed"]] - 1.0 for r in recs if r["seed"] in base]
        if not costs:
            continue  # no fp32 baseline at this group count and seed to measure a cost against
        entry = {
            "row": name,
            "outer_optimizer": row.rule or "nesterov",
            "outer_lr": first["outer_lr"],
            "outer_momentum": first["outer_momentum"],
            "sparseloco_beta": row.beta if row.rule == "sparseloco" else None,
            "h": first["h"],
            "mode": first["mode"],
            "fragments": first["fragments"],
            "overlap_steps": first["overlap_steps"] if first["mode"] == "overlap" else 1,
            "groups": first["groups"],
            "seeds": sorted(r["seed"] for r in recs),
            "eval_loss": round(sum(r["eval_loss"] for r in recs) / len(recs), 5),
            "loss_cost": round(sum(costs) / len(costs), 5),
            "bits_per_param_per_step": round(sum(r["bits_per_param_per_step"] for r in recs) / len(recs), 6),
            "schedule": first["schedule"],
            "paced_gamma": row.paced_gamma,
            "residual_decay": row.residual_decay,
            "merge_alpha": row.merge_alpha,
            **_codec_options(row, first["codec"]),
        }
        entries.append(Setting.from_json(entry).to_json())  # in Setting's order, the codec's options in its place
    dates = sorted({r["date"] for recs in by_row.values() for r in recs})
    return {
        "what": f"settings the convergence study measured at size {SIZE} (8,000 inner steps, a 2-layer d64 GPT); "
                "loss_cost: eval loss / fp32 DiLoCo's (m{G}-h30-outer, same seed) - 1; bits_per_param_per_step: "
                "all groups together",
        "size": SIZE,
        "study_dates": [dates[0], dates[-1]] if dates else [],
        "source": "bench/results/convergence.json",
        "source_sha256": source_sha256,
        "commit": _git("rev-parse", "--short", "HEAD"),
        "regenerate": COMMAND,
        "entries": entries,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--out", default=str(TABLE))
    p.add_argument("--check", action="store_true", help="compare with the table written, do not write")
    args = p.parse_args(argv)
    raw = Path(args.results).read_bytes()
    table = build(json.loads(raw), hashlib.sha256(raw).hexdigest())
    out = Path(args.out)
    if args.check:
        old = json.loads(out.read_text())
        same = old["entries"] == table["entries"]
        print(f"{out}: {'up to date' if same else 'differs from the study: rerun ' + COMMAND}")
        return 0 if same else 1
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out}: {len(table['entries'])} settings measured at {SIZE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
