"""Convergence study: eval loss of DiLoCo's modes and codecs against data parallel, at equal tokens.

What runs (the code path). Every row trains the demo GPT through the same pieces as ``diloco run``:
the task (``diloco.demo.gpt_task``), the inner optimizer (``diloco.runtime.rank.worker.make_inner_optimizer``),
the engine built from the config (``diloco.runtime.rank.worker.make_engine``: DiLoCo in every mode, or data
parallel) and the training loop itself (``diloco.runtime.rank.train_loop.train``: lr schedule, grad clip, engine
steps, final eval of the global model). What differs from a real job is only where the groups live:
the G groups are G threads of this process, each with its own model, inner optimizer and engine
(one rank per group, no DDP wrapper: a DDP group of one rank only copies the gradients), and each
with its own real ``transport.TcpTransport`` on 127.0.0.1. Pseudo-gradients (and, for ``dp``,
gradients) are averaged by ``diloco.exchange.striped.StripedAverager`` over those transports: the ring
all-reduce of a real job, with the codec applied exactly as there (partial sums re-encoded along
the reduce-scatter, the owner quantizes each reduced chunk once, every group decodes the same
bytes), stripes cut as ``diloco run --probe-bytes 0`` cuts them. Not exercised: the coordinator
(quorums, heartbeats, round hashes), bandwidth probes, the in-group broadcast. ``--real`` runs
the selected rows as real ``diloco run`` jobs instead (``diloco.runtime.launch.launcher.run``: a coordinator and G
torchrun groups of one rank, ``--probe-bytes 0``); they give the final eval loss and bytes but no
loss curve (only its two ends), and cost ~20 s of start-up each on 2 cores, which is why the
study runs in-process. ``--check-real ROW`` runs one row both ways and prints both results.

Equal tokens. Every row of one size takes the same number of inner steps T with the same global
batch of B sequences per step, split evenly over its G groups (B/G each, as in Charles et al.
2025): tokens = G x (B/G) x T x block_size, the same for data parallel (G=2, gradients averaged
every step: one step of B sequences), DiLoCo M=1 (one group of B) and M=2, 4.

Eval loss: the global (outer) model's mean cross-entropy (nats/token) on a fixed held-out set
(the corpus' validation tail, ``--eval-batches`` windows x 16 sequences, the same for every row:
``study_task`` only swaps the demo task's eval set for it), at ``curve_points`` steps along the run
and at the end.

Sweeps (stage ``sweep``, one seed; the study rows then use the winners): the inner peak lr for
data parallel and for DiLoCo (M=2, H=30) over ``INNER_LRS``, then the outer (lr, momentum) of
DiLoCo at M=2, H=30 over ``OUTER_SWEEP`` (the DiLoCo default 0.7 / 0.9 among them; both in
``bench/convergence_rows.py``, with the sizes and rows). Every
DiLoCo row uses the DiLoCo inner lr and the default outer settings; ``m{M}-h30-outer`` rows repeat
M=1, 2, 4 at H=30 with the best outer settings when those differ from the default. ``--dp-lr``,
``--diloco-lr``, ``--outer-lr``/``--outer-momentum`` fix them instead (``--quick`` uses 1e-3 for
both inner lrs and the default outer settings, and no sweep).

Record fields (``--json PATH``: a list of them, rewritten after every run; ``--resume`` keeps the
file's records and skips the (size, row, seed) already there): ``row``, ``stage``, ``size``,
``mode`` (``dp`` for the baseline; else the engine's mode), ``codec``, ``groups``, ``h`` (1 for dp;
H_base for QSR, with ``schedule``), ``fragments``, ``overlap_steps``, ``seed``, ``steps``,
``batch_per_group``, ``tokens``, ``num_parameters``, ``inner_lr``, ``outer_lr``, ``outer_momentum``,
``eval_loss``, ``initial_eval_loss``, ``bytes_sent`` (all groups together, measured by the
transports' byte counters: payload and framing, the initial-parameter check included), ``syncs``
(exchanges launched: outer syncs, one per fragment sync; dp: gradient all-reduces), ``periods``,
``bits_per_param_per_step``, ``curve`` (a list of ``{step, tokens, bytes, eval_loss}``),
``params_identical``, ``seconds``, ``path`` (``in-process`` or ``diloco-run``).

bits_per_param_per_step = 8 x bytes_sent / (num_parameters x steps): the bits all groups together
sent to each other per model parameter per inner step (``diloco.runtime.launch.summary.bits_per_param_per_step``,
the figure ``diloco run`` prints); the tables and the progress lines divide it by G: per sending
group. Data parallel's fp32 ring all-reduce moves 2(G-1)/G x 4 bytes per parameter per group per
step: 64 (G-1) / G bits per group, 64 (G-1) for all groups together (32 and 64 with the baseline's two
groups; measured here a little above: framing).

    python bench/convergence.py --quick                    # 7 rows, small model, one seed: < 10 min on 2 cores
    python bench/convergence.py                            # the whole study, both sizes (hours; resumable)
    python bench/convergence.py --resume --only 'm2-*'     # some rows, added to the file
    python bench/convergence.py --table                    # the markdown table of the file's records
    python bench/convergence.py --paired                   # each row paired by seed with the best fp32 DiLoCo
    python bench/convergence.py --paired --against m2-h200-outer   # ... or with one named row

One run of one row is bench/convergence_run.py's; the table, the QSR comparison and the PNG
are bench/convergence_report.py's.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(ROOT) not in sys.path:  # not bench/ itself: its transport.py would shadow the package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.convergence_report import dp_reference, mean_loss, paired_table, plot, qsr_report, table  # noqa: E402
from bench.convergence_rows import (  # noqa: E402
    DEFAULT_OUTER,
    OUTER_SWEEP,
    QUICK_ROWS,
    QUICK_SIZE,
    SIZES,
    Row,
    Size,
    quick_rows,
    study_rows,
    sweep_rows,
)
from bench.convergence_run import (  # noqa: E402
    EVAL_BATCH,
    Settings,
    make_config,
    make_record,
    run_in_process,
    run_real,
)

DEFAULT_JSON = BENCH / "results" / "convergence.json"
QUICK_JSON = BENCH / "results" / "convergence_quick.json"


# --- the study ------------------------------------------------------------------------------------

def _key(r: dict) -> tuple:
    return (r["size"], r["row"], r["seed"])


def _best(records: list[dict], size: str, candidates: list[tuple[str, object]]) -> tuple:
    """(mean eval loss, value) of the candidate row of ``size`` with the lowest mean eval loss."""
    scored = [(mean_loss(records, size, name), value) for name, value in candidates]
    scored = [(loss, v) for loss, v in scored if loss is not None]
    return min(scored, key=lambda lv: lv[0]) if scored else (None, None)


def _best_inner(records: list[dict], size: str, family: str) -> tuple:
    names = sorted({r["row"] for r in records if r["size"] == size and r["row"].startswith(f"sweep-{family}-lr")})
    return _best(records, size, [(n, next(r["inner_lr"] for r in records if r["row"] == n)) for n in names])


def settings_from(records: list[dict], size: str, a: argparse.Namespace) -> Settings:
    """The study's learning rates for ``size``: flags first, else the sweep's winners in
    ``records`` (those of the size it is ``tuned_on``, if any), else the defaults (1e-3, 1e-3, outer
    0.7 / 0.9)."""
    s = Settings()
    src = (SIZES[size].tuned_on or size) if size in SIZES else size  # whose sweeps
    for attr, flag, family in (("dp_lr", a.dp_lr, "dp"), ("diloco_lr", a.diloco_lr, "diloco")):
        if flag:
            setattr(s, attr, flag)
            s.source[attr] = "flag"
            continue
        loss, lr = _best_inner(records, src, family)
        if lr is not None:
            setattr(s, attr, lr)
            s.source[attr] = f"sweep{'' if src == size else ' of ' + src}, eval {loss:.4f}"
    if a.outer_lr or a.outer_momentum:
        s.outer = (a.outer_lr or DEFAULT_OUTER[0], a.outer_momentum or DEFAULT_OUTER[1])
        s.source["outer"] = "flag"
        return s
    candidates: list[tuple[str, object]] = [(f"sweep-outer-lr{o[0]:g}-mom{o[1]:g}", o) for o in OUTER_SWEEP]
    _, default_lr = _best_inner(records, src, "diloco")  # the default outer's run: that sweep's best
    if default_lr is not None:
        candidates.append((f"sweep-diloco-lr{default_lr:g}", DEFAULT_OUTER))
    loss, o = _best(records, src, candidates)
    if o is not None:
        s.outer = tuple(o)
        s.source["outer"] = f"sweep{'' if src == size else ' of ' + src}, eval {loss:.4f}"
    return s


def select(rows: list[Row], only: str | None) -> list[Row]:
    if not only:
        return rows
    pats = [p.strip() for p in only.split(",") if p.strip()]
    return [r for r in rows if any(fnmatch.fnmatchcase(r.name, p) for p in pats)]


def plan(a: argparse.Namespace) -> list[tuple[Size, list[Row], list[Row]]]:
    """(size, its sweep rows, its study rows) for every size this invocation asks for."""
    if a.quick:
        size = replace(QUICK_SIZE, steps=a.steps or QUICK_SIZE.steps)
        return [(size, [], select(quick_rows(), a.only))]
    out = []
    for name in a.sizes.split(","):
        if name not in SIZES:
            raise SystemExit(f"unknown size {name!r}; sizes: {', '.join(SIZES)}")
        size = replace(SIZES[name], steps=a.steps or SIZES[name].steps, seeds=a.seeds or SIZES[name].seeds)
        fixed = a.dp_lr and a.diloco_lr and (a.outer_lr or a.outer_momentum)
        sweeps = [] if a.no_sweep or fixed or size.tuned_on else select(sweep_rows(size), a.only)
        rows = [r for r in select(study_rows(), a.only) if size.rows is None or r.name in size.rows]
        out.append((size, sweeps, rows))
    return out


def seeds_for(size: Size, row: Row, first: int) -> list[int]:
    n = size.seeds if row.seeded else 1
    return [first + i for i in range(n)]


def _with_file(path: Path, records: list[dict]) -> list[dict]:
    """``records`` and those another run (of this script, at the same time) saved to ``path`` since
    this one read it, so that two runs on one file keep each other's records."""
    if not path.exists():
        return records
    mine = {_key(r) for r in records}
    return records + [r for r in json.loads(path.read_text()) if _key(r) not in mine]


def save(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")  # two runs on one file: a name each
    tmp.write_text(json.dumps(records, indent=1))
    os.replace(tmp, path)


def run_study(a: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)  # one thread per group, as diloco run's --threads-per-rank 1
    path = Path(a.json) if a.json else (QUICK_JSON if a.quick else DEFAULT_JSON)
    keep = (a.resume or a.only) and path.exists()  # else a new file
    records: list[dict] = json.loads(path.read_text()) if keep else []
    done = {_key(r) for r in records} if a.resume else set()
    runner = run_real if a.real else run_in_process
    t_all = time.perf_counter()
    for size, sweeps, rows in plan(a):
        stages = [("sweep-inner", [r for r in sweeps if r.outer is None]),
                  ("sweep-outer", [r for r in sweeps if r.outer is not None]), ("study", rows)]
        for stage, stage_rows in stages:
            lrs = settings_from(records, size.name, a) if not a.quick else Settings(source={"all": "quick defaults"})
            todo = [(r, s) for r in stage_rows for s in seeds_for(size, r, a.seed)]
            if stage == "study":
                if lrs.outer == DEFAULT_OUTER:  # the tuned-outer rows would repeat the default ones
                    skipped = sorted({r.name for r, _ in todo if r.outer_tuned})
                    todo = [(r, s) for r, s in todo if not r.outer_tuned]
                    if skipped:
                        print(f"[{size.name}] not run: {', '.join(skipped)}: their outer step is the sweep's winner, "
                              f"and the winner in {path} is the default {DEFAULT_OUTER[0]:g}/{DEFAULT_OUTER[1]:g} "
                              f"(no outer sweep there?); run the sweep or give --outer-lr/--outer-momentum", flush=True)
                if todo:
                    print(f"[{size.name}] learning rates: dp {lrs.dp_lr:g}, diloco {lrs.diloco_lr:g}, "
                          f"outer {lrs.outer[0]:g}/{lrs.outer[1]:g} ({lrs.source or 'defaults'})", flush=True)
            for i, (row, seed) in enumerate(todo, 1):
                if (size.name, row.name, seed) in done:
                    continue
                cfg = make_config(size, row, seed, lrs, a.eval_batches)
                if stage == "sweep-outer":  # the outer sweep runs at DiLoCo's best inner lr
                    cfg.inner.lr = lrs.diloco_lr
                t0 = time.perf_counter()
                rec = make_record(size, row, seed, cfg, runner(cfg))
                records = [r for r in _with_file(path, records) if _key(r) != _key(rec)] + [rec]
                done.add(_key(rec))
                save(path, records)
                ref = dp_reference(records, size.name)
                vs = f" ({100 * (rec['eval_loss'] / ref - 1):+.2f}% vs dp)" if ref and row.mode != "dp" else ""
                print(f"[{size.name} {stage} {i}/{len(todo)}] {row.name} seed {seed}: eval {rec['eval_loss']:.4f}{vs}, "
                      f"{rec['bytes_sent'] / 1e6:.2f} MB, {rec['syncs']} syncs, "
                      f"{rec['bits_per_param_per_step'] / rec['groups']:.3g} bits/param/step per group, "
                      f"{time.perf_counter() - t0:.1f} s",
                      flush=True)
    print(f"done: {len(records)} records in {path} ({time.perf_counter() - t_all:.0f} s this run)", flush=True)
    return records


def check_real(a: argparse.Namespace) -> int:
    """One row both ways (in-process, then a real ``diloco run`` job), side by side."""
    torch.set_num_threads(1)
    size = QUICK_SIZE if a.quick else SIZES[a.sizes.split(",")[0]]
    if a.steps:
        size = replace(size, steps=a.steps)
    row = next(r for r in study_rows() + sweep_rows() if r.name == a.check_real)
    cfg = make_config(size, row, a.seed, Settings(), a.eval_batches)
    out = []
    for runner in (run_in_process, run_real):
        res = runner(copy.deepcopy(cfg))
        out.append(res)
        print(f"{res['path']:>10}: eval {res['eval_loss']:.6f} (initial {res['initial_eval_loss']:.6f}), "
              f"{res['bytes_sent']:,} B, {res['syncs']} syncs, {res['seconds']:.1f} s", flush=True)
    same = out[0]["eval_loss"] == out[1]["eval_loss"]
    print(f"eval loss {'identical' if same else 'differs by %.2e' % abs(out[0]['eval_loss'] - out[1]['eval_loss'])}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"rows {', '.join(QUICK_ROWS)}; small model, {QUICK_SIZE.steps} steps, one seed, no sweep")
    p.add_argument("--json", help="records file (default results/convergence.json beside this script; "
                                  "--quick: results/convergence_quick.json)")
    p.add_argument("--plot", help="PNG of loss against tokens and bytes (default: the JSON's path, .png)")
    p.add_argument("--resume", action="store_true",
                   help="keep the file's records and skip the (size, row, seed) already in it")
    p.add_argument("--only", help="comma-separated row names or globs (e.g. 'dp,m2-*'; the sweep's are sweep-*); "
                                  "the file's other records are kept")
    p.add_argument("--sizes", default="small,medium", help=f"of {', '.join(SIZES)}")
    p.add_argument("--steps", type=int, default=0, help="inner steps per row (default: the size's)")
    p.add_argument("--seeds", type=int, default=0, help="seeds of the seeded rows (default: the size's)")
    p.add_argument("--seed", type=int, default=1, help="first seed")
    p.add_argument("--eval-batches", type=int, default=20, help=f"eval batches of {EVAL_BATCH} sequences")
    p.add_argument("--no-sweep", action="store_true", help="no lr sweep: flags or the file's sweep, else defaults")
    p.add_argument("--dp-lr", type=float, default=0.0)
    p.add_argument("--diloco-lr", type=float, default=0.0)
    p.add_argument("--outer-lr", type=float, default=0.0)
    p.add_argument("--outer-momentum", type=float, default=0.0)
    p.add_argument("--real", action="store_true", help="run the rows as real diloco run jobs (no loss curves)")
    p.add_argument("--check-real", metavar="ROW", help="run ROW in-process and as a diloco run job; print both")
    p.add_argument("--table", action="store_true", help="print the tables of the JSON's records and exit")
    p.add_argument("--against", metavar="ROW",
                   help="with --paired: pair every row with ROW of its size instead of the best fp32 DiLoCo row")
    p.add_argument("--paired", action="store_true",
                   help="print every row of the JSON's records paired by seed with the best fp32 DiLoCo row of its "
                        "size and M (per-seed %%, mean, 95 %% Student-t interval) and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.check_real:
        return check_real(a)
    path = Path(a.json) if a.json else (QUICK_JSON if a.quick else DEFAULT_JSON)
    if a.paired:
        print(paired_table(json.loads(path.read_text()), against=a.against))
        return 0
    records = json.loads(path.read_text()) if a.table else run_study(a)
    # a run prints the tables of the sizes it trained, not the whole file's
    shown = records if a.table else [r for r in records if r["size"] in {s.name for s, _, _ in plan(a)}]
    print(table(shown))
    if any(r["stage"] == "sweep" for r in shown):
        print("\nsweep:\n" + table(shown, "sweep"))
    for line in qsr_report(shown):
        print(line)
    png = Path(a.plot) if a.plot else path.with_suffix(".png")
    if (a.plot or not a.table) and plot(records, png):
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
