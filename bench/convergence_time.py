"""Rounds by time against fixed H at equal tokens (issue 32, point 1): rows of the convergence
study (``bench/convergence.py``'s task, config, learning rates and record format) whose groups run
at different speeds.

Speeds are virtual, so a row is exact and repeatable whatever the machine's load: each group has
its own clock that a training step advances by the group's step cost (``speeds``: 1 = full speed,
2 = half speed), and an exchange ends, on every group's clock, when its last contribution arrived
(as a blocking exchange does in wall time). The engine's rule is the real one (``TimeRounds``,
``round_over``, the lr following ``time_progress``) on those clocks. The groups are threads of this
process averaging through ``InProcessGroups`` (fp32, weighted by each group's inner steps; the
``-unweighted`` row takes the plain mean, to show what the weights do).

A time row runs as many rounds as fixed H (``ceil(steps / H)``), each ``S`` virtual seconds, ``S``
set so the groups together train the fixed-H row's tokens: ``S = G * steps / (rounds * sum(1 /
speed))``. ``fixed-h30`` is the baseline through the same runner (with fixed H the speeds change
nothing but the wall time, so its loss is that of any speeds).

    python bench/convergence_time.py --sizes small --json /tmp/conv_time.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ itself: its transport.py would shadow the package

import torch

from bench.convergence_rows import SIZES, Row, spec
from bench.convergence_run import (
    _Model,
    _Recorder,
    make_config,
    make_record,
    run_groups,
    study_task,
)
from compress.codec_spec import CodecSpec
from diloco.engine.averaging import InProcessGroups
from diloco.job.task import TaskContext
from diloco.runtime.rank.train_loop import LoopOptions, train
from diloco.runtime.rank.worker import engine_options, make_engine, make_inner_optimizer

DEFAULT_JSON = ROOT / "bench" / "results" / "convergence.json"


@dataclass(frozen=True)
class TimeRow:
    name: str
    speeds: tuple[float, ...] = (1.0, 1.0)  # virtual seconds per step of each group
    timed: bool = True  # rounds by time (False: fixed H)
    weighted: bool = True
    h: int = 30
    mode: str = "blocking"  # or overlap (Streaming DiLoCo: ``fragments``, ``tau``)
    fragments: int = 1
    tau: int = 0
    codec: CodecSpec = field(default_factory=CodecSpec)  # the codec and its options (``spec(...)``)
    rule: str = ""  # "sparseloco": SparseLoCo's outer rule (with codec topk)
    seeded: bool = False
    note: str = ""


ROWS = (
    TimeRow("fixed-h30", timed=False, seeded=True, note="fixed H=30, blocking: the baseline at equal tokens"),
    TimeRow("time-h30-equal", note="rounds by time, both groups at full speed"),
    TimeRow("time-h30-slow2", speeds=(1.0, 2.0), seeded=True, note="rounds by time, group 1 at half speed"),
    TimeRow("time-h30-slow2-unweighted", speeds=(1.0, 2.0), weighted=False,
            note="as time-h30-slow2, the plain mean instead of the token-weighted one"),
    TimeRow("time-h30-slow4", speeds=(1.0, 4.0), note="rounds by time, group 1 at quarter speed"),
    TimeRow("fixed-overlap-p2-tau5", timed=False, mode="overlap", fragments=2, tau=5, seeded=True,
            note="fixed H=30, overlap with 2 fragments, tau 5: the streaming baseline at equal tokens"),
    TimeRow("time-overlap-p2-tau5-slow2", speeds=(1.0, 2.0), mode="overlap", fragments=2, tau=5, seeded=True,
            note="rounds by time, overlap with 2 fragments, tau 5, group 1 at half speed"),
    TimeRow("fixed-slo-overlap-p2-tau5", timed=False, mode="overlap", fragments=2, tau=5, codec=spec("topk"),
            rule="sparseloco", note="fixed H=30, SparseLoCo with overlap (2 fragments, tau 5)"),
    TimeRow("time-slo-overlap-p2-tau5-equal", mode="overlap", fragments=2, tau=5, codec=spec("topk"), rule="sparseloco",
            note="rounds by time, SparseLoCo with overlap (2 fragments, tau 5), equal speeds"),
)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _ClockedMember:
    """An ``InProcessGroups`` member whose exchange ends, on this group's clock, when the last
    group posted its contribution."""

    def __init__(self, member, clock: _Clock, posted: dict, lock: threading.Lock) -> None:
        self.member, self.clock, self.posted, self.lock = member, clock, posted, lock
        self.weighted, self.num_groups, self.group_index = member.weighted, member.num_groups, member.group_index
        self.error_feedback = member.error_feedback  # topk, sign1, int2: the engine keeps the residual
        self.recorder = None

    def start(self, flat, *, tag, exact=False, **kw):
        with self.lock:
            self.posted.setdefault(tag, []).append(self.clock.t)
        pending, me = self.member.start(flat, tag=tag, exact=exact, **kw), self

        class _Pending:
            sent = getattr(pending, "sent", None)  # error feedback: what the others decoded of ours

            def wait(self):
                mean = pending.wait()
                with me.lock:
                    me.clock.t = max(me.clock.t, *me.posted[tag])
                return mean

        return _Pending()

    def all_reduce_mean(self, flat, *, round: int):
        return self.start(flat, tag=f"r{round}", exact=True).wait()

    def observe(self, engine, events) -> None:
        if self.recorder is not None:
            self.recorder.observe(engine, events)


class _Link(_Recorder):
    """What ``train_loop.train`` reports through (``_Recorder``), with what it reads of a real connection."""

    averager = None
    fault_stats = SimpleNamespace(healed=False)


def _timed_loss(loss, clock: _Clock, cost: float):
    def step_loss(net, batch):
        if net.training:  # one training step: this group's clock advances by its cost
            clock.t += cost
        return loss(net, batch)
    return step_loss


def run_time_row(cfg, row: TimeRow) -> dict:
    """Train ``cfg`` with ``row``'s speeds; the raw result ``make_record`` takes."""
    g_count = len(row.speeds)
    cpu = torch.device("cpu")
    rounds = math.ceil(cfg.train.steps / cfg.sync.h)
    seconds = g_count * cfg.train.steps / (rounds * sum(1 / s for s in row.speeds))
    groups = InProcessGroups(g_count, timeout_s=600, weighted=row.weighted,
                             codec=None if row.codec.codec == "fp32" else cfg.transport.codec_spec().build())
    posted: dict = {}
    lock = threading.Lock()
    clocks = [_Clock() for _ in range(g_count)]
    tasks, inners, links, members = [], [], [], []
    for g in range(g_count):  # in turn: gpt_task seeds the global RNG to build the initial weights
        ctx = TaskContext(group=g, num_groups=g_count, rank=0, group_size=1, device=cpu, seed=cfg.train.seed,
                          steps=cfg.train.steps, batch_size=cfg.data.batch_size, data_path=cfg.data.path,
                          args={}, config=cfg)
        task = study_task(ctx)
        task.loss = _timed_loss(task.loss, clocks[g], row.speeds[g])
        tasks.append(task)
        inners.append(make_inner_optimizer(cfg.inner, task.model))
        link = _Link(g, None, task)
        links.append(link)
        member = _ClockedMember(groups.member(g), clocks[g], posted, lock)
        member.recorder = link
        members.append(member)
    summaries: list[dict | None] = [None] * g_count
    errors: list[BaseException] = []

    def group_thread(g: int) -> None:
        try:
            timed = copy.deepcopy(cfg)
            timed.sync.round_seconds = seconds if row.timed else 0.0  # TimeRounds(seconds, ceil(steps / H))
            engine = make_engine(tasks[g].model, inners[g], members[g], tasks[g].fragments, clock=clocks[g],
                                 **engine_options(timed))
            links[g].engine = engine
            summaries[g] = train(LoopOptions.of(cfg),
                                 g, 0 if g == 0 else 1, cpu, _Model(tasks[g].model), tasks[g], inners[g],
                                  engine, links[g])
            summaries[g].update(round_steps=list(getattr(engine, "round_steps", [])), inner_steps=engine.inner_step)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    seconds = run_groups(group_thread, g_count, errors)
    s0 = summaries[0]
    tokens = sum(int(s["tokens"]) for s in summaries)
    return {
        "eval_loss": s0["eval_loss"], "initial_eval_loss": s0["initial_eval_loss"], "tokens": tokens, "bytes_sent": 0,
        "syncs": s0["outer_rounds"], "num_parameters": s0["num_parameters"], "periods": s0["round_steps"],
        "params_identical": len({s["param_hash"] for s in summaries}) == 1, "seconds": seconds,
        "path": "in-process, virtual clocks",
        "curve": [{"step": 0, "tokens": 0, "bytes": 0, "eval_loss": s0["initial_eval_loss"]},
                  {"step": cfg.train.steps, "tokens": tokens, "bytes": 0, "eval_loss": s0["eval_loss"]}],
        "time_rounds": {"speeds": list(row.speeds), "timed": row.timed, "weighted": row.weighted,
                        "round_seconds": seconds if row.timed else None, "rounds": rounds,
                        "steps_per_group": [int(s["inner_steps"]) for s in summaries],
                        "steps_per_round": [s["round_steps"] for s in summaries],
                        "virtual_seconds": max(c.t for c in clocks)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small", help=f"of {', '.join(SIZES)}")
    p.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    p.add_argument("--seeds", type=int, default=3, help="seeds of the seeded rows (others: the first)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="inner steps per row (default: the size's)")
    p.add_argument("--json", required=True, help="records file (a JSON list; records of the same row, size and "
                                                 "seed are replaced)")
    p.add_argument("--study-json", default=str(DEFAULT_JSON), help="the study's records: its sweep's learning rates")
    a = p.parse_args(argv)
    from bench.convergence import settings_from

    torch.set_num_threads(1)  # one thread per group, as the study
    study = json.loads(Path(a.study_json).read_text()) if Path(a.study_json).exists() else []
    out_path = Path(a.json)
    records = json.loads(out_path.read_text()) if out_path.exists() else []
    flags = SimpleNamespace(dp_lr=0.0, diloco_lr=0.0, outer_lr=0.0, outer_momentum=0.0)
    rows = [r for r in ROWS if not a.rows or r.name in a.rows.split(",")]
    for size_name in a.sizes.split(","):
        size = replace(SIZES[size_name], steps=a.steps or SIZES[size_name].steps)
        lrs = settings_from(study, size_name, flags)
        for row in rows:
            for seed in range(a.seed, a.seed + (a.seeds if row.seeded else 1)):
                study_row = Row(row.name, groups=len(row.speeds), h=row.h, mode=row.mode, fragments=row.fragments,
                                tau=row.tau, codec=row.codec, rule=row.rule, note=row.note)
                cfg = make_config(size, study_row, seed, lrs)
                t0 = time.perf_counter()
                result = run_time_row(cfg, row)
                rec = make_record(size, study_row, seed, cfg, result)
                rec.update(time_rounds=result["time_rounds"], lr_source=lrs.source)
                records = [r for r in records if (r["size"], r["row"], r["seed"]) != (size.name, row.name, seed)]
                records.append(rec)
                out_path.write_text(json.dumps(records, indent=1))
                tr = result["time_rounds"]
                print(f"[{size.name}] {row.name} seed {seed}: eval {rec['eval_loss']:.4f}, tokens {rec['tokens']:,}, "
                      f"steps per group {tr['steps_per_group']}, identical {rec['params_identical']}, "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
