"""One run of one row of the convergence study (`bench/convergence.py` plans the runs and
records them): the study's task and config, a run with the G groups as threads of this process
over real transports on 127.0.0.1 (`run_in_process`, with a loss curve), or as a real ``diloco
run`` job (`run_real`), and the record of a run. The module doc of `bench/convergence.py` says
what each path exercises and what the record fields mean.
"""

from __future__ import annotations

import datetime
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # not bench/ itself: its transport.py would shadow the package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.convergence_rows import DEFAULT_OUTER, Row, Size  # noqa: E402
from compress.codec_spec import codec_options  # noqa: E402
from diloco.demo import data as data_mod  # noqa: E402
from diloco.engine.averaging import SingleGroup  # noqa: E402
from diloco.exchange.fault_stats import FaultStats  # noqa: E402
from diloco.exchange.striped import StripedAverager  # noqa: E402
from diloco.job.config import Config  # noqa: E402
from diloco.demo import gpt_task  # noqa: E402
from diloco.job.task import Task, TaskContext  # noqa: E402
from diloco.runtime.launch.summary import bits_per_param_per_step  # noqa: E402
from diloco.runtime.rank.endpoint import group_keys, make_transport  # noqa: E402
from diloco.runtime.rank.train_loop import LoopOptions, evaluate, train
from diloco.runtime.rank.worker import engine_options, make_engine, make_inner_optimizer  # noqa: E402

ENTRY = "bench.convergence_run:study_task"  # this file, importable with the repository root on the path
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
    if row.outer or row.outer_tuned:  # otherwise the mode's own defaults (diloco.engine.outer.MODE_DEFAULTS)
        cfg.outer.lr, cfg.outer.momentum = row.outer or lrs.outer
    if row.co2:
        cfg.outer.co2_lr, cfg.outer.co2_momentum = row.co2
    if row.rule:
        cfg.outer.optimizer = row.rule  # its own lr and momentum (sparseloco: 1, none) unless the row sets them
        cfg.outer.sparseloco_beta = row.beta
    cfg.outer.residual_decay, cfg.outer.alpha = row.residual_decay, row.merge_alpha
    s = cfg.sync
    s.mode, s.h, s.fragments, s.schedule = row.mode, max(row.h, row.fragments), row.fragments, row.schedule
    s.qsr_gamma, s.paced_gamma = row.qsr_gamma, row.paced_gamma
    s.overlap_steps = row.tau if row.mode == "overlap" else 1
    cfg.topology.groups, cfg.topology.ranks_per_group, cfg.topology.threads_per_rank = row.groups, 1, 1
    cfg.train.steps, cfg.train.seed, cfg.train.entry = size.steps, seed, ENTRY
    cfg.train.log_every = max(1, size.steps // 10)  # loss-curve points
    t = cfg.transport
    for option in codec_options():  # the row's codec spec, every option (TransportConfig holds them by name)
        setattr(t, option.name, getattr(row.codec, option.name))
    t.timeout_s, t.probe_bytes, t.reprobe_every = 300.0, 0, 0
    return cfg.validate()


# --- one run, in-process --------------------------------------------------------------------------

class _Recorder:
    """What ``train_loop.train`` reports through its link (``report_progress``, ``summary``) and what the
    engine tells its averager (``observe``): bytes at every report, the periods chosen, and (group 0)
    the global model's eval loss every ``log_every`` steps."""

    def __init__(self, group: int, transport, task: Task) -> None:
        self.group, self.transport, self.task = group, transport, task
        self.group_size = 1
        self.engine = None
        self.averager = None  # no quorum: no data positions, nothing to heal from
        self.fault_stats = FaultStats()
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
                self.curve.append((step, evaluate(model, self.task, torch.device("cpu"))))

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
    """Stands where ``train_loop.train`` expects the DDP wrapper: calls the model, exposes it as ``module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):  # training, eval(), train(): the model's
        return getattr(self.module, name)


def run_groups(group_thread, g_count: int, errors: list[BaseException]) -> float:
    """Run ``group_thread(g)`` for every group in a thread of its own; the seconds they took
    together. Raises the first error a group put in ``errors``."""
    started = time.perf_counter()
    threads = [threading.Thread(target=group_thread, args=(g,), name=f"group-{g}") for g in range(g_count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


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
            inners.append(make_inner_optimizer(cfg.inner, task.model))
            rec = _Recorder(g, transports[g], task)
            rec.every = cfg.train.log_every
            recorders.append(rec)
            if g_count == 1:
                averagers.append(_Single(rec))
            else:
                avg = _Averager(transports[g], members, group=g, rank=0, codec=cfg.transport.codec_spec().build(),
                                timeout_s=cfg.transport.timeout_s, stripes_per_rank=cfg.transport.stripes_per_rank)
                avg.recorder = rec
                averagers.append(avg)
        summaries: list[dict | None] = [None] * g_count
        errors: list[BaseException] = []

        def group_thread(g: int) -> None:
            try:
                engine = make_engine(tasks[g].model, inners[g], averagers[g], tasks[g].fragments, **engine_options(cfg))
                recorders[g].engine = engine
                # groups other than 0 skip the evals, as ranks other than 0 do in a real job
                summaries[g] = train(LoopOptions.of(cfg),
                                     g, 0 if g == 0 else 1, cpu, _Model(tasks[g].model), tasks[g], inners[g],
                                      engine, recorders[g])
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)
                for t in transports:  # the other groups' exchanges abort instead of waiting out the timeout
                    if t is not None:
                        t.close(flush_timeout_s=0.1)

        seconds = run_groups(group_thread, g_count, errors)
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

    from diloco.runtime.launch import launcher

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
        "row": row.name, "stage": row.stage, "size": size.name, "mode": row.mode, "codec": row.codec.codec,
        "groups": row.groups, "h": 1 if row.mode == "dp" else row.h, "schedule": row.schedule,
        **({"qsr_gamma": row.qsr_gamma} if row.schedule == "qsr" else {}),
        **({"paced_gamma": row.paced_gamma} if row.schedule == "paced" else {}),
        "fragments": row.fragments, "overlap_steps": row.tau if row.mode == "overlap" else 0, "seed": seed,
        **({"merge_alpha": cfg.outer.merge_alpha(row.mode)} if row.mode == "overlap" else {}),
        "outer_rule": cfg.outer.optimizer, "topk_density": row.codec.topk_density,
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
