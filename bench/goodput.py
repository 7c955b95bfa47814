"""Goodput of real ``diloco run`` jobs on this machine (issue 32, point 4).

Cases are functions (``CASES``); each returns its JSON section, and ``--json`` writes one object
with a section per case (a case run again replaces its own section only, so cases can be run
apart and a new one — the fault case — added beside the others).

slow-group: two groups of one rank (one thread each), group 1 at half speed. Half speed comes
from the bench's task (``slow_task``, run with ``--entry bench.goodput:slow_task``): the demo GPT
whose loss, in the slowed group, sleeps after each training step for ``factor - 1`` times the
median of that group's last five un-slept step times — a group at ``1/factor`` of its own speed
whatever the machine's load, without using a core while it waits (a CPU quota would also slow its
exchange). Every training step's start time (wall clock) is appended to a trace file per group.
In one run of the bench, in turn:

* solo rates: each group alone in its own job (``--groups 1``, the slowed one with the same task),
  both jobs at the same time so each sees the machine as busy as in a 2-group job; a rate is
  steps x tokens per step / (last step start - first step start), over every step but the first;
* fixed H, blocking, group 1 slowed: the job's tokens per second (all groups' steps in the job's
  window, from the first step any group starts to the last) against the sum of the solo rates;
* rounds by time (``--round-seconds S``), group 1 slowed, as many rounds as fixed H, S set from
  the solo rates so the job trains about the tokens of the equal-speed job;
* fixed H, both groups at full speed, as many steps per group as the time rounds' job trained in
  all over 2 (its tokens): the reference for loss per token.

Each job's rate is also set against its own groups' busy rates, measured in the same job at the
same moments: a group's steps over its window less its time in syncs (exchanges and waiting),
summed over the groups. That ratio shares the load of the moment with the job it judges, so it
does not move with the other work on the machine as the solo jobs' rates do.

``--repeats N`` runs the whole sequence N times (the spread between repeats is the noise: the
machine's 2 cores are shared with other work).

faults: G groups (default 8), a random group's process tree SIGKILLed every N s, against the same
job without faults run at the same time (bench/goodput_faults.py)::

    python bench/goodput.py --cases faults --intervals 30 --faults 20 --json bench/results/goodput.json

with ``--repeats N`` each interval's pair is run N times. Its numerator is the committed-sample
ledger, each range once (``goodput_faults.commits_from_logs``), and the bench stops with an error if a
window holds more tokens than its job committed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ itself: its transport.py would shadow the package

from bench.goodput_faults import parse_intervals
from diloco.demo import gpt_task
from diloco.job.config import Config
from diloco.job.task import Task, TaskContext
from diloco.runtime.launch.chaos import KINDS, ChaosMonkey, ChaosPlan

ENTRY = "bench.goodput:slow_task"


# --- the bench's task: the demo, one group slowed, every step traced --------------------------------

class _Throttle:
    """Wraps a task's loss: in training mode, records each step's start time and (when slowed)
    sleeps ``factor - 1`` times the median of the last five un-slept step times first; with
    ``pace`` (seconds, 0: off) it first sleeps until ``pace`` after the previous step's start."""

    def __init__(self, loss: Callable, factor: float, trace: Path | None, pace: float = 0.0) -> None:
        self.loss, self.factor, self.trace, self.pace = loss, factor, trace, pace
        self.last: float | None = None
        self.work: list[float] = []

    def __call__(self, net, batch):
        if not net.training:  # evaluation: neither slowed nor traced
            return self.loss(net, batch)
        now = time.time()
        if self.pace > 0 and self.last is not None and now < self.last + self.pace:
            time.sleep(self.last + self.pace - now)
            now = time.time()
        if self.last is not None:  # the previous step's own work: from the end of its sleep to now
            self.work = (self.work + [now - self.last])[-5:]
        if self.factor > 1 and self.work:
            time.sleep((self.factor - 1) * statistics.median(self.work))
        self.last = time.time()
        if self.trace is not None:
            with self.trace.open("a") as f:
                f.write(f"{self.last:.6f}\n")
        return self.loss(net, batch)


def slow_task(ctx: TaskContext) -> Task:
    """The demo GPT task; entry args ``slow_group`` (the group slowed, -1: none), ``factor``
    (2: half speed), ``trace`` (a folder for each group's step times, or empty) and ``pace``
    (seconds: every group's steps start at least this far apart, as on hardware of its own;
    0 or absent: as fast as it can)."""
    args = ctx.args
    slowed = int(args.get("slow_group", "-1")) == ctx.group
    trace = Path(args["trace"]) / f"group-{ctx.group}-rank-{ctx.rank}.txt" if args.get("trace") else None
    task = gpt_task(ctx)
    task.loss = _Throttle(task.loss, float(args.get("factor", "2")) if slowed else 1.0, trace,
                          pace=float(args.get("pace", "0")))
    return task


# --- one job -------------------------------------------------------------------------------------------

def _config(args, *, groups: int, slow_group: int, trace: Path, round_seconds: float = 0.0,
            steps: int | None = None) -> Config:
    cfg = Config()
    cfg.topology.groups, cfg.topology.ranks_per_group, cfg.topology.threads_per_rank = groups, 1, 1
    cfg.train.steps, cfg.sync.h = steps or args.steps, args.h
    cfg.sync.round_seconds = round_seconds
    cfg.sync.mode, cfg.sync.fragments = args.mode, args.fragments
    cfg.sync.overlap_steps = args.overlap_steps if args.mode == "overlap" else 1
    cfg.train.entry = ENTRY
    cfg.train.entry_args = f"slow_group={slow_group},factor={args.factor},trace={trace}"
    cfg.train.log_every = 50
    return cfg.validate()


def _steps_of(trace: Path) -> dict[int, list[float]]:
    return {int(p.name.split("-")[1]): [float(x) for x in p.read_text().split()] for p in trace.glob("group-*-rank-0.txt")}


def _child(cfg_path: str, out_path: str, run_dir: str) -> int:
    """In a child process: run the job of ``cfg_path`` (a config dict) and write its summary."""
    from diloco.job.config_parse import from_dict
    from diloco.runtime.launch import launcher

    cfg = from_dict(json.loads(Path(cfg_path).read_text())).validate()
    job = Path(cfg_path).with_name("job.json")
    opts = json.loads(job.read_text()) if job.exists() else {}
    chaos = None
    if opts.get("chaos"):
        c = opts["chaos"]
        chaos = _TimedChaos(c["kills"], seed=c["seed"], gap_s=tuple(c["gap_s"]), pause_s=tuple(c["pause_s"]),
                            stop_fraction=c["stop_fraction"], kinds=tuple(c.get("kinds", ("kill",))),
                            stall_s=tuple(c.get("stall_s", (10.0, 10.0))))
    try:
        s = launcher.run(cfg, run_dir=run_dir, progress=False, timeout_s=opts.get("timeout_s", 900), chaos=chaos)
    finally:
        if chaos is not None:
            Path(cfg_path).with_name("kills.json").write_text(json.dumps(chaos.killed))
    Path(out_path).write_text(json.dumps(s, default=str))
    return 0


class _TimedChaos(ChaosMonkey):
    """The fault drill, also noting each fault's wall-clock time and group (``killed``: kills and
    stalls alike); its clock starts once every group reported training (no fault while the groups
    start up)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.killed: list[tuple[float, int]] = []

    def tick(self, now: float, **kw) -> ChaosPlan:
        if kw["progress"] <= 0 and not self.kills_done:
            return ChaosPlan()
        plan = super().tick(now, **kw)
        self.killed += [(time.time(), g) for g in plan.kill + plan.stall]
        return plan


def _jobs_folder(args, stack: contextlib.ExitStack) -> str:
    """Where the jobs' folders go: ``--keep DIR`` (left there: logs, traces, summaries), else a
    temporary folder removed with ``stack``."""
    if getattr(args, "keep", None):
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        return tempfile.mkdtemp(prefix="goodput-", dir=args.keep)
    return stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-goodput-"))


def run_jobs(args, jobs: dict[str, dict], *, configure: Callable | None = None, record: Callable | None = None,
             timeout_s: float = 900) -> dict[str, dict]:
    """Run ``jobs`` (name: ``configure`` keywords, default ``_config``'s; a ``chaos`` entry, the
    ``ChaosMonkey`` arguments, drills the job) at the same time, each a ``diloco run`` job in its
    own process; returns each one's ``record(name, kw, cfg, summary, folder)`` (default: rates
    from its step trace, eval loss and tokens)."""
    configure = configure or _config
    record = record or (lambda name, kw, cfg, s, d: _record(name, kw, cfg, s, _steps_of(d / "trace")))
    out = {}
    with contextlib.ExitStack() as stack:
        tmp = _jobs_folder(args, stack)
        procs, cfgs = {}, {}
        try:
            for name, kw in jobs.items():
                d = Path(tmp) / name
                (d / "trace").mkdir(parents=True)
                cfgs[name] = cfg = configure(args, trace=d / "trace", **{k: v for k, v in kw.items() if k != "chaos"})
                (d / "config.json").write_text(json.dumps(cfg.to_dict()))
                (d / "job.json").write_text(json.dumps({"chaos": kw.get("chaos"), "timeout_s": timeout_s}))
                err = stack.enter_context((d / "stderr").open("w"))
                procs[name] = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--child", str(d / "config.json"),
                     str(d / "summary.json"), str(d / "run")], stdout=subprocess.DEVNULL, stderr=err)
            for name, proc in procs.items():
                if proc.wait() != 0:
                    raise RuntimeError(f"job {name} failed (exit {proc.returncode}): "
                                       f"{(Path(tmp) / name / 'stderr').read_text()[-2000:]}")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
        for name, kw in jobs.items():
            d = Path(tmp) / name
            s = json.loads((d / "summary.json").read_text())
            out[name] = record(name, kw, cfgs[name], s, d)
    return out


def _record(name: str, kw: dict, cfg: Config, s: dict, times: dict[int, list[float]]) -> dict:
    tokens_per_step = cfg.data.batch_size * cfg.model.block_size
    first, last = min(t[0] for t in times.values()), max(t[-1] for t in times.values())
    steps = {g: len(t) for g, t in times.items()}
    # the job's rate: every step but each group's first, over the job's window of step starts
    window = last - first
    rate = sum(n - 1 for n in steps.values()) * tokens_per_step / window
    # each group's rate while it computes (its window less its time in syncs: exchanges and waits),
    # measured in this job, under this moment's load: what it would train alone, as the machine is now
    sync = {int(g): float(v) for g, v in s["sync_seconds_per_group"].items()}
    busy = {g: (len(t) - 1) * tokens_per_step / max(t[-1] - t[0] - sync.get(g, 0.0), 1e-9) for g, t in times.items()}
    rec = {
        "case": name, "groups": cfg.topology.groups, "slow_group": kw["slow_group"], "steps": cfg.train.steps,
        "round_seconds": cfg.sync.round_seconds, "steps_per_group": steps, "tokens": s["tokens"],
        "tokens_per_s": rate, "window_s": window, "eval_loss": s["eval_loss"], "outer_rounds": s["outer_rounds"],
        "periods": s["periods"], "params_identical": s["params_identical"], "wall_s": s["seconds"],
        "sync_seconds_per_group": sync, "busy_tokens_per_s_per_group": busy,
        "tokens_per_s_over_busy_sum": rate / sum(busy.values()),
    }
    print(f"  {name}: {rate:,.0f} tokens/s over {window:.1f} s ({100 * rec['tokens_per_s_over_busy_sum']:.1f} % of its "
          f"groups' busy rates {', '.join(f'{b:,.0f}' for b in busy.values())}), steps {steps}, "
          f"eval loss {s['eval_loss']:.4f}", flush=True)
    return rec


# --- the cases --------------------------------------------------------------------------------------------

def case_slow_group(args) -> dict:
    """One group at 1/factor speed: fixed H (blocking) and rounds by time against the sum of the
    groups' solo rates, and loss per token against equal-speed groups (module doc)."""
    repeats = []
    n = args.repeats or 2
    for r in range(n):
        print(f"slow-group, repeat {r + 1} of {n}", flush=True)
        # both solo jobs at once: each group alone in its job, on a machine as busy as in the 2-group jobs
        solo = run_jobs(args, {"solo-fast": {"groups": 1, "slow_group": -1}, "solo-slow": {"groups": 1, "slow_group": 0}})
        fast, slow = solo["solo-fast"], solo["solo-slow"]
        solo_sum = fast["tokens_per_s"] + slow["tokens_per_s"]
        fixed = run_jobs(args, {"fixed-h-slow": {"groups": 2, "slow_group": 1}})["fixed-h-slow"]
        tokens_per_step = fast["tokens"] / args.steps
        # seconds per round so that both groups together train 2·H steps a round at their solo rates
        rate_steps = solo_sum / tokens_per_step
        seconds = 2 * args.h / rate_steps
        timed = run_jobs(args, {"time-rounds-slow": {"groups": 2, "slow_group": 1, "round_seconds": round(seconds, 3)}}
                         )["time-rounds-slow"]
        # equal speeds at the tokens the time rounds trained: the loss per token to compare with
        steps_equal = max(round(sum(timed["steps_per_group"].values()) / 2), args.h)
        equal = run_jobs(args, {"fixed-h-equal": {"groups": 2, "slow_group": -1, "steps": steps_equal}})["fixed-h-equal"]
        repeats.append({
            "runs": [fast, slow, fixed, timed, equal], "solo_sum_tokens_per_s": solo_sum,
            "fixed_h_ratio": fixed["tokens_per_s"] / solo_sum, "time_rounds_ratio": timed["tokens_per_s"] / solo_sum,
            "round_seconds": round(seconds, 3),
            "loss_vs_equal_speed": timed["eval_loss"] / equal["eval_loss"] - 1,
            "tokens_vs_equal_speed": timed["tokens"] / equal["tokens"] - 1,
            "fixed_h_loss_vs_equal_speed": fixed["eval_loss"] / equal["eval_loss"] - 1,
            "fixed_h_ratio_in_job": fixed["tokens_per_s_over_busy_sum"],
            "time_rounds_ratio_in_job": timed["tokens_per_s_over_busy_sum"],
        })
        print(f"  -> fixed H {100 * repeats[-1]['fixed_h_ratio']:.1f} %, rounds by time "
              f"{100 * repeats[-1]['time_rounds_ratio']:.1f} % of the solo sum; loss vs equal speed "
              f"{100 * repeats[-1]['loss_vs_equal_speed']:+.2f} % at {100 * repeats[-1]['tokens_vs_equal_speed']:+.1f} % "
              f"tokens; against the groups' busy rates in the job: fixed H {100 * fixed['tokens_per_s_over_busy_sum']:.1f} %, "
              f"rounds by time {100 * timed['tokens_per_s_over_busy_sum']:.1f} %", flush=True)
        args.save(_section(args, repeats))
    return _section(args, repeats)


def _section(args, repeats: list[dict]) -> dict:
    keys = ("fixed_h_ratio", "time_rounds_ratio", "fixed_h_ratio_in_job", "time_rounds_ratio_in_job",
            "loss_vs_equal_speed", "tokens_vs_equal_speed")
    return {
        "settings": {"steps": args.steps, "h": args.h, "factor": args.factor, "repeats": args.repeats or 2,
                     "mode": args.mode, "fragments": args.fragments,
                     "overlap_steps": args.overlap_steps if args.mode == "overlap" else 0,
                     "ranks_per_group": 1, "threads_per_rank": 1, "entry": ENTRY},
        "summary": {k: {"mean": statistics.mean(r[k] for r in repeats),
                        "min": min(r[k] for r in repeats), "max": max(r[k] for r in repeats)} for k in keys},
        "repeats": repeats,
        "date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count(),
    }


def case_faults(args) -> dict:
    """A group SIGKILLed every ``interval`` s against the same job without faults (bench/goodput_faults.py)."""
    from bench.goodput_faults import case_faults as run_case

    return run_case(args, run_jobs, ENTRY)


CASES: dict[str, Callable] = {"slow-group": case_slow_group, "faults": case_faults}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="slow-group", help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--steps", type=int, default=200, help="inner steps per group of the fixed-H jobs")
    p.add_argument("--h", type=int, default=20, help="H of the fixed-H jobs (rounds: steps / H)")
    p.add_argument("--factor", type=float, default=2.0, help="the slowed group runs at 1/factor of its speed")
    p.add_argument("--repeats", type=int, help="slow-group case: runs of the whole sequence [2]; faults case: pairs "
                   "run per interval, one after the other, the same settings and drill seed [1] (their spread: the noise)")
    p.add_argument("--mode", default="blocking", choices=("blocking", "overlap"),
                   help="slow-group case: the sync mode of every job (overlap: Streaming DiLoCo's)")
    p.add_argument("--fragments", type=int, default=1, help="slow-group case: fragments of every job")
    p.add_argument("--overlap-steps", type=int, default=2, help="slow-group case with --mode overlap: tau")
    f = p.add_argument_group("faults case (bench/goodput_faults.py)")
    f.add_argument("--groups", type=int, default=8, help="groups of one rank (one thread each)")
    f.add_argument("--intervals", default="30", help="seconds between faults, comma-separated; 'none': a "
                   "fault-free job alone (each interval runs its own fault-free twin)")
    f.add_argument("--faults", type=int, default=20, help="faults per faulty job (fewer if it ends first)")
    f.add_argument("--kinds", default="kill", help="fault kinds, comma-separated, each fault's drawn from them: "
                   "kill (SIGKILL of a random group's process tree, restarted 0.5 s later), stall (SIGSTOP of it "
                   "for --stall-seconds, then SIGCONT), corrupt (one bit flipped in what a random group receives "
                   "next, by a relay in front of its data plane: diloco.runtime.launch.link_relays)")
    f.add_argument("--stall-seconds", type=float, default=6.0, help="how long a stalled group stays frozen (make it "
                   "longer than --heartbeat-timeout: the group is then declared failed, restarts and heals)")
    f.add_argument("--fault-steps", type=int, default=0, help="inner steps per group of every job (0: enough for "
                   "--faults at the pace)")
    f.add_argument("--pace-ms", type=float, default=50.0, help="every group's steps start at least this far apart "
                   "(ms), as on hardware of its own: a group that is down then loses its share instead of handing "
                   "its cores to the others (0: as fast as the machine goes)")
    f.add_argument("--fault-h", type=int, default=20, help="H of the fault case's jobs")
    f.add_argument("--round-seconds", type=float, default=0.0, help="rounds by time in the fault case (0: fixed H)")
    f.add_argument("--quorum-grace", type=float, default=1.0, help="--quorum-grace of the fault case's jobs (the "
                   "paced groups ask for an exchange together; 0: off, survivors wait out the heartbeat timeout)")
    f.add_argument("--heartbeat-timeout", type=float, default=3.0)
    f.add_argument("--spares", type=int, default=0, help="warm spares of every job (diloco run --spares): a restarted "
                   "group becomes one at once instead of starting python and torch")
    f.add_argument("--collective-timeout", type=float, default=10.0)
    f.add_argument("--together", action=argparse.BooleanOptionalAction, default=True,
                   help="run each faulty job and its fault-free twin at the same time (--no-together: one after "
                   "the other)")
    f.add_argument("--equal-tokens", action="store_true", help="also run a fault-free job of each faulty job's "
                   "committed tokens (eval loss at equal tokens, exactly)")
    f.add_argument("--seed", type=int, default=7, help="the jobs' seed and the fault drill's")
    f.add_argument("--job-timeout", type=float, default=1800, help="seconds before a fault-case job counts as hung")
    f.add_argument("--plot", help="PNG of goodput against fault interval, e.g. bench/results/goodput_faults.png")
    p.add_argument("--keep", metavar="DIR", help="keep every job's folder (group logs, step traces, summaries) under "
                   "DIR instead of deleting it [default: deleted]")
    p.add_argument("--json", help="write (merge) the sections here, e.g. bench/results/goodput.json")
    p.add_argument("--recount", nargs="+", metavar="JSON", help="print what the faults records of these files "
                   "(a folder: its goodput*.json), written before the numerator counted each committed range once, "
                   "still tell, and exit")
    p.add_argument("--child", nargs=3, metavar=("CONFIG", "SUMMARY", "RUN_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(*args.child)
    if args.recount:
        from bench.goodput_faults import recount_files

        recount_files(args.recount)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_jobs' finally stops the jobs
    if args.factor < 1 or not math.isfinite(args.factor):
        p.error(f"--factor must be >= 1, got {args.factor}")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        p.error(f"--kinds {args.kinds!r}: some of {', '.join(KINDS)}")
    args.kinds = ",".join(kinds)
    if "stall" in kinds and not args.stall_seconds > args.heartbeat_timeout:
        p.error(f"--stall-seconds ({args.stall_seconds:g}) must exceed --heartbeat-timeout "
                f"({args.heartbeat_timeout:g}): a shorter stall is never declared a failure, only waited for")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.groups < 2 or args.faults < 0:
        p.error(f"--groups must be >= 2 and --faults >= 0, got {args.groups} and {args.faults}")
    try:
        parse_intervals(args.intervals)
    except ValueError as e:
        p.error(f"--intervals: {e}")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = {}
    if args.json and Path(args.json).exists():
        out = json.loads(Path(args.json).read_text())
    for name in filter(None, args.cases.split(",")):
        if name not in CASES:
            p.error(f"unknown case {name!r}; choose from {', '.join(CASES)}")

        def save(section: dict, name: str = name) -> None:  # after every repeat: a stopped run keeps its data
            out[name] = section
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

        args.save, args.previous = save, out.get(name)  # previous: the case's section from an earlier run, if any
        save(CASES[name](args))
    print(json.dumps({k: v.get("summary") for k, v in out.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
