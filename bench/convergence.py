"""Convergence study: eval loss of DiLoCo's modes and codecs against data parallel, at equal tokens.

What runs (the code path). Every row trains the demo GPT through the same pieces as ``diloco run``:
the task (``diloco.task.gpt_task``), the inner optimizer (``diloco.worker.make_inner_optimizer``),
the engine built from the config (``diloco.worker.make_engine``: DiLoCo in every mode, or data
parallel) and the training loop itself (``diloco.worker._train``: lr schedule, grad clip, engine
steps, final eval of the global model). What differs from a real job is only where the groups live:
the G groups are G threads of this process, each with its own model, inner optimizer and engine
(one rank per group, no DDP wrapper: a DDP group of one rank only copies the gradients), and each
with its own real ``transport.TcpTransport`` on 127.0.0.1. Pseudo-gradients (and, for ``dp``,
gradients) are averaged by ``diloco.group.StripedAverager`` over those transports: the ring
all-reduce of a real job, with the codec applied exactly as there (partial sums re-encoded along
the reduce-scatter, the owner quantizes each reduced chunk once, every group decodes the same
bytes), stripes cut as ``diloco run --probe-bytes 0`` cuts them. Not exercised: the coordinator
(quorums, heartbeats, round hashes), bandwidth probes, the in-group broadcast. ``--real`` runs
the selected rows as real ``diloco run`` jobs instead (``diloco.launcher.run``: a coordinator and G
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
sent to each other per model parameter per inner step (``diloco.launcher.bits_per_param_per_step``,
the figure ``diloco run`` prints). Data parallel's fp32 ring all-reduce moves 2(G-1)/G x 4 bytes
per parameter per group per step: 64 (G-1) bits, 64 with the baseline's two groups (measured
here a little above: framing).

    python bench/convergence.py --quick                    # 7 rows, small model, one seed: < 10 min on 2 cores
    python bench/convergence.py                            # the whole study, both sizes (hours; resumable)
    python bench/convergence.py --resume --only 'm2-*'     # some rows, added to the file
    python bench/convergence.py --table                    # the markdown table of the file's records

The table, the QSR comparison and the PNG are bench/convergence_report.py's.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import fnmatch
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(ROOT) not in sys.path:  # not bench/ itself: its transport.py would shadow the package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.convergence_report import dp_reference, mean_loss, plot, qsr_report, table  # noqa: E402
from bench.convergence_rows import (  # noqa: E402
    DEFAULT_OUTER, OUTER_SWEEP, QUICK_ROWS, QUICK_SIZE, SIZES, Row, Size, quick_rows, study_rows, sweep_rows)
from diloco import data as data_mod  # noqa: E402
from diloco.averaging import SingleGroup  # noqa: E402
from diloco.config import Config  # noqa: E402
from diloco.connection import group_keys, make_transport  # noqa: E402
from diloco.group import StripedAverager  # noqa: E402
from diloco.launcher import bits_per_param_per_step  # noqa: E402
from diloco.task import Task, TaskContext, gpt_task  # noqa: E402
from diloco.wire_codec import make_codec  # noqa: E402
from diloco.worker import _evaluate, _train, make_engine, make_inner_optimizer  # noqa: E402

DEFAULT_JSON = BENCH / "results" / "convergence.json"
QUICK_JSON = BENCH / "results" / "convergence_quick.json"
ENTRY = "bench.convergence:study_task"  # this file, importable with the repository root on the path
EVAL_BATCH = 16  # sequences per eval batch, whatever a row's batch per group


# --- the task and the config ----------------------------------------------------------------------

def study_task(ctx: TaskContext) -> Task:
    """The demo task (``gpt_task``) with the study's fixed eval set: ``eval_batches`` batches of
    ``EVAL_BATCH`` sequences from the validation tail, whatever the rank's batch size."""
    task = gpt_task(ctx)
    cfg = ctx.config if ctx.config is not None else Config()
    _, val = data_mod.split(data_mod.load_corpus(cfg.data.path or None), cfg.data.val_fraction)
    task.eval_batches = data_mod.eval_batches(val, EVAL_BATCH, cfg.model.block_size, cfg.data.eval_batches)
    return task


@dataclass
class Settings:
    """The learning rates the study rows use (from flags, the sweep's records, or the defaults)."""

    dp_lr: float = 1e-3
    diloco_lr: float = 1e-3
    outer: tuple[float, float] = DEFAULT_OUTER
    source: dict = field(default_factory=dict)


def make_config(size: Size, row: Row, seed: int, lrs: Settings, eval_batches: int = 20) -> Config:
    if size.batch % row.groups:
        raise ValueError(f"batch {size.batch} does not split over {row.groups} groups")
    cfg = Config()
    m = cfg.model
    m.n_layer, m.n_head, m.n_embd, m.block_size = size.n_layer, size.n_head, size.n_embd, size.block
    cfg.data.batch_size = size.batch // row.groups
    cfg.data.eval_batches = eval_batches
    cfg.inner.lr = row.inner_lr if row.inner_lr is not None else (lrs.dp_lr if row.family == "dp" else lrs.diloco_lr)
    cfg.inner.warmup_steps = size.warmup or max(1, size.steps // 20)
    if row.outer or row.outer_tuned:  # otherwise the mode's own defaults (diloco.outer.MODE_DEFAULTS)
        cfg.outer.lr, cfg.outer.momentum = row.outer or lrs.outer
    if row.co2:
        cfg.outer.co2_lr, cfg.outer.co2_momentum = row.co2
    s = cfg.sync
    s.mode, s.h, s.fragments, s.schedule = row.mode, max(row.h, row.fragments), row.fragments, row.schedule
    s.overlap_steps = row.tau if row.mode == "overlap" else 1
    cfg.topology.groups, cfg.topology.ranks_per_group, cfg.topology.threads_per_rank = row.groups, 1, 1
    cfg.train.steps, cfg.train.seed, cfg.train.entry = size.steps, seed, ENTRY
    cfg.train.log_every = max(1, size.steps // 10)  # loss-curve points
    t = cfg.transport
    t.codec, t.timeout_s, t.probe_bytes, t.reprobe_every = row.codec, 300.0, 0, 0
    return cfg.validate()


# --- one run, in-process --------------------------------------------------------------------------

class _Recorder:
    """What ``_train`` reports through its link (``report_progress``, ``summary``) and what the
    engine tells its averager (``observe``): bytes at every report, the periods chosen, and (group 0)
    the global model's eval loss every ``log_every`` steps."""

    def __init__(self, group: int, transport, task: Task) -> None:
        self.group, self.transport, self.task = group, transport, task
        self.group_size = 1
        self.engine = None
        self.bytes_at: dict[int, int] = {0: 0}
        self.curve: list[tuple[int, float]] = []
        self.periods: list[int] = []
        self.every = 0

    def sent(self) -> int:
        return int(self.transport.bytes_sent) if self.transport is not None else 0

    def report_progress(self, *, loss=None, step=0, steps=0, lr=None, tokens_per_step=None, **_) -> None:
        self.bytes_at[step] = self.sent()
        if self.group == 0 and self.every and step % self.every == 0 and step < steps:
            with self.engine.global_weights() as model:
                self.curve.append((step, _evaluate(model, self.task, torch.device("cpu"))))

    def observe(self, engine, events) -> None:
        self.periods += [e.next_period for e in events if e.kind == "launch" and e.next_period]

    def summary(self, engine, **kw) -> dict:
        return {**kw, "group": self.group, "outer_rounds": engine.round, "param_hash": engine.global_hash(),
                "bytes_sent": self.sent(), "num_parameters": engine.numel}


class _Averager(StripedAverager):
    """``StripedAverager`` that also tells the recorder what the engine did (``observe``)."""

    recorder: _Recorder | None = None

    def observe(self, engine, events) -> None:
        if self.recorder is not None:
            self.recorder.observe(engine, events)


class _Single(SingleGroup):
    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def observe(self, engine, events) -> None:
        self.recorder.observe(engine, events)


class _Static:
    """Membership of an in-process job: groups 0..G-1, sorted ring, one address each."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.groups = list(range(len(addresses)))
        self.ring_order = list(self.groups)

    def ranks(self, group: int) -> list[str]:
        return [self.addresses[group]]


class _Model:
    """Stands where ``_train`` expects the DDP wrapper: calls the model, exposes it as ``module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def run_in_process(cfg: Config) -> dict:
    """Train one configuration with its G groups as threads of this process (see the module doc);
    returns the raw result (summaries of every group, curve, bytes)."""
    g_count = cfg.topology.groups
    cpu = torch.device("cpu")
    job_secret = secrets.token_bytes(32)
    transports = [make_transport(cfg.transport, group_keys(job_secret, g)) for g in range(g_count)] if g_count > 1 else [None]
    try:
        members = _Static([t.address for t in transports]) if g_count > 1 else None
        tasks, inners, recorders, averagers = [], [], [], []
        for g in range(g_count):  # in turn: gpt_task seeds the global RNG to build the initial weights
            ctx = TaskContext(group=g, num_groups=g_count, rank=0, group_size=1, device=cpu, seed=cfg.train.seed,
                              steps=cfg.train.steps, batch_size=cfg.data.batch_size, data_path=cfg.data.path,
                              args={}, config=cfg)
            task = study_task(ctx)  # what build_task(cfg.train.entry, ctx) returns, without the import
            tasks.append(task)
            inners.append(make_inner_optimizer(cfg, task.model))
            rec = _Recorder(g, transports[g], task)
            rec.every = cfg.train.log_every
            recorders.append(rec)
            if g_count == 1:
                averagers.append(_Single(rec))
            else:
                avg = _Averager(transports[g], members, group=g, rank=0, codec=make_codec(cfg.transport),
                                timeout_s=cfg.transport.timeout_s, stripes_per_rank=cfg.transport.stripes_per_rank)
                avg.recorder = rec
                averagers.append(avg)
        summaries: list[dict | None] = [None] * g_count
        errors: list[BaseException] = []

        def group_thread(g: int) -> None:
            try:
                engine = make_engine(cfg, tasks[g].model, inners[g], averagers[g], tasks[g].fragments)
                recorders[g].engine = engine
                # groups other than 0 skip the evals, as ranks other than 0 do in a real job
                summaries[g] = _train(cfg, g, 0 if g == 0 else 1, cpu, _Model(tasks[g].model), tasks[g], inners[g],
                                      engine, recorders[g])
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)
                for t in transports:  # the other groups' exchanges abort instead of waiting out the timeout
                    if t is not None:
                        t.close(flush_timeout_s=0.1)

        started = time.perf_counter()
        threads = [threading.Thread(target=group_thread, args=(g,), name=f"group-{g}") for g in range(g_count)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        seconds = time.perf_counter() - started
        if errors:
            raise errors[0]
    finally:
        for t in transports:
            if t is not None:
                t.close()
    s0 = summaries[0]
    steps = cfg.train.steps
    per_step_tokens = sum(cfg.data.batch_size for _ in range(g_count)) * cfg.model.block_size
    curve_steps = [0] + [st for st, _ in recorders[0].curve] + [steps]
    losses = [s0["initial_eval_loss"]] + [v for _, v in recorders[0].curve] + [s0["eval_loss"]]
    bytes_sent = sum(s["bytes_sent"] for s in summaries)
    curve = []
    for st, loss in zip(curve_steps, losses):
        b = bytes_sent if st == steps else sum(r.bytes_at.get(st, 0) for r in recorders)
        curve.append({"step": st, "tokens": st * per_step_tokens, "bytes": b, "eval_loss": loss})
    return {
        "eval_loss": s0["eval_loss"], "initial_eval_loss": s0["initial_eval_loss"],
        "tokens": sum(int(s["tokens"]) for s in summaries), "bytes_sent": bytes_sent,
        "syncs": s0["outer_rounds"], "num_parameters": s0["num_parameters"], "periods": recorders[0].periods,
        "params_identical": len({s["param_hash"] for s in summaries}) == 1, "seconds": seconds,
        "curve": curve, "path": "in-process",
    }


def run_real(cfg: Config) -> dict:
    """The same configuration as a real ``diloco run`` job (coordinator + torchrun groups)."""
    import tempfile

    from diloco import launcher

    env_path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in env_path.split(os.pathsep):  # the workers import ENTRY from the repository
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env_path]))
    with tempfile.TemporaryDirectory(prefix="bench-convergence-") as tmp:
        s = launcher.run(cfg, run_dir=tmp, progress=False, timeout_s=3600)
    steps = cfg.train.steps
    per_step_tokens = cfg.topology.groups * cfg.data.batch_size * cfg.model.block_size
    return {
        "eval_loss": s["eval_loss"], "initial_eval_loss": s["initial_eval_loss"], "tokens": s["tokens"],
        "bytes_sent": s["bytes_sent"], "syncs": s["outer_rounds"] if cfg.sync.mode != "dp" else steps,
        "num_parameters": s["num_parameters"], "periods": s["periods"], "params_identical": s["params_identical"],
        "seconds": s["seconds"], "path": "diloco-run",
        "curve": [{"step": 0, "tokens": 0, "bytes": 0, "eval_loss": s["initial_eval_loss"]},
                  {"step": steps, "tokens": steps * per_step_tokens, "bytes": s["bytes_sent"],
                   "eval_loss": s["eval_loss"]}],
    }


def make_record(size: Size, row: Row, seed: int, cfg: Config, result: dict) -> dict:
    steps = cfg.train.steps
    return {
        "row": row.name, "stage": row.stage, "size": size.name, "mode": row.mode, "codec": row.codec,
        "groups": row.groups, "h": 1 if row.mode == "dp" else row.h, "schedule": row.schedule,
        "fragments": row.fragments, "overlap_steps": row.tau if row.mode == "overlap" else 0, "seed": seed,
        "steps": steps, "batch_per_group": cfg.data.batch_size, "block_size": cfg.model.block_size,
        "n_layer": cfg.model.n_layer, "n_embd": cfg.model.n_embd,
        "inner_lr": cfg.inner.lr, "warmup_steps": cfg.inner.warmup_steps,
        "outer_lr": None if row.mode == "dp" else cfg.outer.co2_lr if row.mode == "co2" else cfg.outer.outer_lr(row.mode),
        "outer_momentum": None if row.mode == "dp" else
        cfg.outer.co2_momentum if row.mode == "co2" else cfg.outer.outer_momentum(row.mode),
        **{k: result[k] for k in ("tokens", "num_parameters", "eval_loss", "initial_eval_loss", "bytes_sent",
                                  "syncs", "periods", "params_identical", "seconds", "path", "curve")},
        "bits_per_param_per_step": bits_per_param_per_step(result["bytes_sent"], result["num_parameters"], steps),
        "note": row.note,
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
    }


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
    0.7 / 0.9). A size without its own outer sweep takes the small model's winner."""
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
    on = src if SIZES.get(src, SIZES["small"]).outer_sweep else "small"
    candidates: list[tuple[str, object]] = [(f"sweep-outer-lr{o[0]:g}-mom{o[1]:g}", o) for o in OUTER_SWEEP]
    _, default_lr = _best_inner(records, on, "diloco")  # the default outer's run: that sweep's best
    if default_lr is not None:
        candidates.append((f"sweep-diloco-lr{default_lr:g}", DEFAULT_OUTER))
    loss, o = _best(records, on, candidates)
    if o is not None:
        s.outer = tuple(o)
        s.source["outer"] = f"sweep{'' if on == size else ' of ' + on}, eval {loss:.4f}"
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


def save(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
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
                    todo = [(r, s) for r, s in todo if not r.outer_tuned]
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
                records = [r for r in records if _key(r) != _key(rec)] + [rec]
                done.add(_key(rec))
                save(path, records)
                ref = dp_reference(records, size.name)
                vs = f" ({100 * (rec['eval_loss'] / ref - 1):+.2f}% vs dp)" if ref and row.mode != "dp" else ""
                print(f"[{size.name} {stage} {i}/{len(todo)}] {row.name} seed {seed}: eval {rec['eval_loss']:.4f}{vs}, "
                      f"{rec['bytes_sent'] / 1e6:.2f} MB, {rec['syncs']} syncs, "
                      f"{rec['bits_per_param_per_step']:.3g} bits/param/step, {time.perf_counter() - t0:.1f} s",
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.check_real:
        return check_real(a)
    path = Path(a.json) if a.json else (QUICK_JSON if a.quick else DEFAULT_JSON)
    if a.table:
        records = json.loads(path.read_text())
    else:
        records = run_study(a)
    print(table(records))
    if any(r["stage"] == "sweep" for r in records):
        print("\nsweep:\n" + table(records, "sweep"))
    for line in qsr_report(records):
        print(line)
    png = Path(a.plot) if a.plot else path.with_suffix(".png")
    if (a.plot or not a.table) and plot(records, png):
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
