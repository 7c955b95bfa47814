"""The fault case of ``bench/goodput.py`` (issue 32, point 4): goodput of a ``diloco run`` job
whose groups are SIGKILLed on a schedule, against the same job without faults.

For each fault interval (``--intervals 30,60``) a pair of jobs runs: the job with a kill every
``interval`` seconds (``ChaosMonkey`` with a fixed gap: a random healthy group's whole process
tree, restarted at once; it heals back in) and its fault-free twin, the same config. With
``--together`` (the default) the pair runs at the same time, so both see the machine's load of the
same moments; goodput is then counted over their common window (from the later of their first
commits to the earlier of their last), else over each job's own window (first to last commit).

Goodput = tokens committed to the global model per second (a group's samples count when the
exchange carrying them commits: the committed-sample ledger each group's rank 0 logs,
``diloco.exchange.data_positions``, each range once as the ledger counts it, a healer's re-logged
rounds included once, timed by its first log line) over the fault-free twin's; the bench stops
(``CountError``) if the numerator and the ledger disagree or a window holds more than its job
committed. The same ledger, checked over every incarnation of every group (``check_ledger``),
counts samples committed twice or left out. Eval loss: both jobs train the same steps per group, so the faulty
job ends with fewer committed tokens (a killed group's uncommitted work is lost and it rejoins at
the job's step); its loss against the twin's is then an upper bound of the ratio at equal tokens
(the twin's loss at fewer tokens is no lower); ``--equal-tokens`` runs a fault-free job of the
faulty job's committed tokens afterwards for the exact ratio (unpaced and without a grace window:
with fixed H its loss does not depend on timing, so it runs as fast as the machine goes).

Pace (``--pace-ms``): every group's steps start at least this far apart, as if each group had
hardware of its own, with the machine's cores not all busy. Without it, on a machine whose cores
every group shares, a group that is down hands its cores to the others, which then train faster:
the job would lose almost nothing to a dead group, which real groups in their own datacenters do.

Faults (``--kinds``): kills, and stalls (``--stall-seconds`` of SIGSTOP of a random group's whole
process tree, then SIGCONT: its links stay open and carry nothing, and it stops heartbeating, as a
hung host or a stalled link would look to the others; longer than the heartbeat timeout, so the
group is declared failed; it heals when it wakes: in place, in the same process, for a group of
one rank). ``downtime_s_per_kill`` (to the group's next step) and ``recovery_s_per_fault`` (to its
next commit) cover both kinds. Corrupting links (kind ``corrupt``): ``diloco run``'s drill puts a relay
(``transport.FaultProxy``) in front of every group's data plane (``diloco.runtime.launch.link_relays``),
and a fault flips one bit of what a random group receives next: the frame fails its check, that
exchange rolls back and runs again; nothing restarts.

The ledger's arithmetic (records in, numbers out) is ``bench/goodput_ledger.py``; here: the jobs' configs, running
the pairs (``case_faults``), each job's record, the summary, the recount of stored records and the plot.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bench.goodput_ledger import check_numerator, commits_from_logs, downtimes, ledger_counts, pair_result, recoveries
from diloco.exchange.data_positions import _ledger_record, ledger_from_logs
from diloco.job.config import Config

BATCH = 8  # sequences per group per step (one rank)


def job_steps(args, interval: float | None) -> int:
    """Inner steps per group: ``--fault-steps``, else (with a pace) enough for ``--faults`` faults
    ``interval`` s apart (30 s for the fault-free pair) before 95 % of the job, plus 30 s, in
    whole rounds of H."""
    if args.fault_steps:
        return args.fault_steps
    if args.pace_ms <= 0:
        raise ValueError("--fault-steps is needed without --pace-ms (the job's length in steps is unknown)")
    seconds = args.faults * (interval or 30.0) / 0.95 + 30.0
    return math.ceil(seconds / (args.pace_ms / 1000) / args.fault_h) * args.fault_h


def fault_config(args, *, trace: Path, entry: str, steps: int | None = None, unpaced: bool = False, **_) -> Config:
    """The jobs' config: the demo GPT at 1 layer x 32 wide (``entry``: ``bench.goodput``'s traced
    task, no group slowed, every group paced at ``--pace-ms`` a step), one rank of one thread per
    group, ``--data-order epochs``. ``unpaced``: as fast as the machine goes and without a grace window
    (fixed H then makes the job's result independent of timing: for the loss at equal tokens)."""
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 32, 2, 32
    cfg.data.batch_size, cfg.data.eval_batches, cfg.data.order = BATCH, 8, "epochs"
    cfg.train.steps, cfg.train.log_every, cfg.train.seed = steps or args.fault_steps, 50, args.seed
    cfg.inner.warmup_steps = 20
    cfg.sync.h, cfg.sync.round_seconds = args.fault_h, args.round_seconds
    cfg.topology.groups, cfg.topology.ranks_per_group, cfg.topology.threads_per_rank = args.groups, 1, 1
    cfg.transport.timeout_s, cfg.transport.probe_bytes = args.collective_timeout, 0
    cfg.fault.heartbeat_timeout, cfg.fault.quorum_grace = args.heartbeat_timeout, 0.0 if unpaced else args.quorum_grace
    cfg.fault.max_restarts = 100  # chaos kills do not count; a group left out while alive does
    cfg.fault.spares = getattr(args, "spares", 0)  # the twin keeps them too, idle
    cfg.train.entry = entry
    cfg.train.entry_args = f"slow_group=-1,factor=1,trace={trace},pace={0 if unpaced else args.pace_ms / 1000}"
    return cfg.validate()


def log_order(path: Path) -> tuple[int, int]:
    """(group, incarnation) of a worker log, ``group-G.log`` then ``group-G.restart-K.log`` by K: the
    order its lines were written in (as text, ``restart-10`` would sort before ``restart-2``)."""
    m = re.fullmatch(r"group-(\d+)(?:\.restart-(\d+))?\.log", path.name)
    if m is None:
        raise ValueError(f"not a worker log's name: {path.name}")
    return int(m[1]), int(m[2] or 0)


def fault_record(name: str, kw: dict, cfg: Config, s: dict, d: Path) -> dict:
    """One job's record from its summary and its folder (run logs, step traces, kill times)."""
    logs = sorted((d / "run").glob("group-*.log"), key=log_order)
    lines = [line for p in logs for line in p.read_text(errors="replace").splitlines()]
    commits = commits_from_logs(lines)
    ranges = ledger_from_logs(lines)
    check_numerator(commits, ranges)
    counts = ledger_counts(ranges)
    tokens_per_sample = cfg.model.block_size
    kills = [tuple(k) for k in json.loads((d / "kills.json").read_text())] if (d / "kills.json").exists() else []
    traces = {int(p.name.split("-")[1]): sorted(float(x) for x in p.read_text().split())
              for p in (d / "trace").glob("group-*-rank-0.txt")}
    down = downtimes(kills, traces)
    back = recoveries(kills, commits)
    f = s["fault"]
    stalls = f["stall_seconds"]
    rec = {
        "case": name, "interval_s": kw.get("interval"), "groups": cfg.topology.groups, "steps": cfg.train.steps,
        "h": cfg.sync.h, "round_seconds": cfg.sync.round_seconds, "quorum_grace_s": cfg.fault.quorum_grace,
        "heartbeat_timeout_s": cfg.fault.heartbeat_timeout, "kills": f["kills"], "frozen": f.get("frozen", 0),
        "corrupted": f.get("corrupted", 0),
        "failures": f["failures"],
        "restarts": f["restarts"], "heals": f["heals"], "rolled_back": f["rolled_back"],
        "spares": cfg.fault.spares, "spares_used": f.get("spares_used", 0),
        "committed_rounds": f["committed"], "stalls": len(stalls), "stall_s_sum": sum(stalls),
        "stall_s_median": statistics.median(stalls) if stalls else 0.0, "stall_s_max": max(stalls, default=0.0),
        "downtime_s_per_kill": down, "downtime_s_median": statistics.median(down) if down else None,
        "recovery_s_per_fault": back, "recovery_s_median": statistics.median(back) if back else None,
        "committed_samples": counts["committed"], "committed_tokens": counts["committed"] * tokens_per_sample,
        "samples_twice": counts["twice"], "samples_left_out": counts["left_out"],
        "data_per_group": s.get("data_per_group"), "eval_loss": s["eval_loss"],
        "initial_eval_loss": s["initial_eval_loss"], "params_identical": s["params_identical"],
        "divergent_rounds": len(s["divergence"]), "wall_s": s["seconds"],
        "commits": commits, "tokens_per_sample": tokens_per_sample,
        # rank 0's committed-range lines, a healer's again-logged ones included (commits: each range once)
        "commit_lines": sum(1 for line in lines if (r := _ledger_record(line)) is not None and r[4] is None),
        # the median time between a group's step starts (the pace, if the machine kept it)
        "step_interval_median_s": statistics.median(b - a for t in traces.values() for a, b in itertools.pairwise(t))
        if any(len(t) > 1 for t in traces.values()) else None,
    }
    print(f"  {name}: {rec['kills']} kills, {rec['frozen']} frozen, {rec['corrupted']} bits flipped, "
          f"{rec['rolled_back']} rolled back, {rec['committed_tokens']:,} tokens committed, "
          f"twice {rec['samples_twice']}, left out {rec['samples_left_out']}, eval loss {rec['eval_loss']:.4f}, "
          f"stalls {len(stalls)} ({rec['stall_s_sum']:.1f} s), down per kill "
          f"{'' if not down else f'median {statistics.median(down):.1f} s'}, wall {rec['wall_s']:.0f} s", flush=True)
    return rec


def parse_intervals(text: str) -> list[float | None]:
    """``"10,30,none"`` -> [10.0, 30.0, None] (None: no faults). ValueError on anything else."""
    out: list[float | None] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part.lower() == "none":
            out.append(None)
            continue
        v = float(part)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"a fault interval is seconds > 0 or 'none', got {part!r}")
        out.append(v)
    if not out:
        raise ValueError("no fault interval given")
    return out


def _label(interval: float | None) -> str:
    return "none" if interval is None else f"{interval:g}s"


def case_faults(args, run_jobs: Callable, entry: str) -> dict:
    """Each interval's faulty job against its fault-free twin (module doc), ``--repeats`` times
    (default once; each repeat a new pair with the same settings and drill seed: their spread is
    the noise); returns the JSON section. Interval ``none``: a fault-free job against its twin (the
    measurement's noise floor). Pairs of other intervals from an earlier run (``args.previous``)
    are kept, each with its own settings. ``run_jobs`` and ``entry`` (the traced task every job
    trains) are ``bench.goodput``'s, which calls this: this module imports nothing of it."""
    asked = {_label(i) for i in parse_intervals(args.intervals)}
    kept = [p for p in ((getattr(args, "previous", None) or {}).get("pairs") or []) if _label(p["interval_s"]) not in asked]
    pairs: list[dict] = []
    repeats = getattr(args, "repeats", None) or 1

    def chaos(interval: float) -> dict:  # a fault every interval s (a kill restarted 0.5 s later, or a stall of
        # --stall-seconds), none in the last 5 %
        return {"kills": args.faults, "gap_s": [interval, interval], "pause_s": [0.5, 0.5], "seed": args.seed,
                "stop_fraction": 0.95, "kinds": args.kinds.split(","), "stall_s": [args.stall_seconds] * 2}

    def run(jobs: dict) -> dict:
        return run_jobs(args, jobs, configure=functools.partial(fault_config, entry=entry), record=fault_record,
                        timeout_s=args.job_timeout)

    for interval in parse_intervals(args.intervals):
        for repeat in range(1, repeats + 1):
            pairs.append(run_pair(args, interval, run, chaos, repeat, repeats))
            args.save(fault_section(args, kept + pairs))
    section = fault_section(args, kept + pairs)
    if args.plot:
        plot(section, args.plot)
    return section


def run_pair(args, interval: float | None, run: Callable, chaos: Callable, repeat: int, repeats: int) -> dict:
    """One faulty job and its twin (at the same time with ``--together``): the pair's record."""
    label = _label(interval)
    print(f"faults: every {label}, {args.groups} groups, up to {args.faults} faults"
          f"{f', repeat {repeat} of {repeats}' if repeats > 1 else ''}", flush=True)
    steps = job_steps(args, interval)
    jobs = {f"every-{label}": {"interval": interval, "steps": steps, **({"chaos": chaos(interval)} if interval else {})},
            f"twin-{label}": {"steps": steps}}
    got = run(jobs) if args.together else {k: v for name, kw in jobs.items() for k, v in run({name: kw}).items()}
    fault, free = got[f"every-{label}"], got[f"twin-{label}"]
    pair = {"interval_s": interval, "repeat": repeat, **pair_result(fault, free, together=args.together,
                                                                     tokens_per_sample=fault["tokens_per_sample"])}
    # group-time the faulty job's groups spent down (kill to first step after it) over its groups' window
    pair["downtime_share"] = sum(fault["downtime_s_per_kill"]) / (args.groups * pair["window_s"])
    # the same, fault to the group's next commit (a frozen group's wake-up, eviction and heal included)
    pair["recovery_share"] = sum(fault["recovery_s_per_fault"]) / (args.groups * pair["window_s"])
    # the exchanges a failure disturbed, first request to commit, over the window: every group waited
    pair["stall_share"] = fault["stall_s_sum"] / pair["window_s"]
    if args.equal_tokens and interval is not None:
        steps = max(args.fault_h, round(fault["committed_tokens"] / (fault["tokens_per_sample"] * BATCH * args.groups)
                                        / args.fault_h) * args.fault_h)
        eq = run({f"equal-{label}": {"steps": steps, "unpaced": True}})[f"equal-{label}"]
        pair["equal_tokens_job"] = {k: eq[k] for k in ("steps", "committed_tokens", "eval_loss")}
        pair["eval_loss_vs_free_at_equal_tokens"] = fault["eval_loss"] / eq["eval_loss"] - 1
    print(f"  -> goodput {100 * pair['goodput']:.1f} % of the fault-free twin over {pair['window_s']:.0f} s; "
          f"eval loss {100 * pair['eval_loss_vs_free_at_equal_steps']:+.2f} % at equal steps "
          f"({100 * pair['tokens_vs_free']:+.1f} % tokens); restarts kept groups down "
          f"{100 * pair['downtime_share']:.1f} % of the group-time (to their next commit: "
          f"{100 * pair['recovery_share']:.1f} %, median {fault['recovery_s_median']} s), stalls "
          f"{100 * pair['stall_share']:.1f} % of the window", flush=True)
    for rec in (fault, free):
        rec["commits"] = len(rec["commits"])  # the count in the JSON; the times were used above
    return {**pair, "settings": settings(args), "fault_job": fault, "free_job": free}


def settings(args) -> dict:
    """The fault case's settings as run (with the date and the command's own words)."""
    return {"groups": args.groups, "intervals": args.intervals, "faults": args.faults,
            "steps": args.fault_steps or "auto", "pace_ms": args.pace_ms, "h": args.fault_h,
            "round_seconds": args.round_seconds, "quorum_grace_s": args.quorum_grace,
            "heartbeat_timeout_s": args.heartbeat_timeout, "collective_timeout_s": args.collective_timeout,
            "together": args.together, "kinds": args.kinds, "stall_s": args.stall_seconds, "data_order": "epochs",
            "model": "demo GPT 1 layer x 32, block 32, batch 8", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python bench/goodput.py " + " ".join(sys.argv[1:])}


def fault_section(args, pairs: list[dict]) -> dict:
    """The JSON section: the latest run's settings, a summary per interval (over its repeats),
    every pair's records (each with the settings it ran with)."""
    return {"settings": settings(args), "summary": fault_summary(pairs), "pairs": pairs,
            "date": time.strftime("%Y-%m-%d")}


def fault_summary(pairs: list[dict]) -> dict:
    """Per interval, over its pairs (repeats): goodput's mean, least, greatest and each; the
    shares' and the loss's means; samples twice and left out summed."""
    out = {}
    for label in dict.fromkeys(_label(p["interval_s"]) for p in pairs):
        ps = [p for p in pairs if _label(p["interval_s"]) == label]
        goodput = [p["goodput"] for p in ps]
        out[label] = {"repeats": len(ps), "goodput": statistics.mean(goodput), "goodput_min": min(goodput),
                      "goodput_max": max(goodput), "goodput_per_repeat": goodput,
                      "faults_per_repeat": [p["fault_job"]["kills"] + p["fault_job"].get("frozen", 0) for p in ps],
                      **{k: statistics.mean(p[src] for p in ps) for k, src in
                         (("downtime_share", "downtime_share"), ("stall_share", "stall_share"),
                          ("eval_loss_vs_free", "eval_loss_vs_free_at_equal_steps"))},
                      "samples_twice": sum(p["fault_job"]["samples_twice"] for p in ps),
                      "samples_left_out": sum(p["fault_job"]["samples_left_out"] for p in ps)}
    return out


# --- records written before the numerator was the ledger (issue 46, point 5) --------------------------------

#: when a healer began to log its group's last advances again (commit 2994ed6, ``log_inherited``); a
#: job's numerator counted those lines again from then on, while its ledger (``committed_samples``)
#: counted them once. Before it the ledger counted every line as the numerator did.
RELOGS_SINCE = "2026-11-26 05:13 UTC"


def recount_pair(pair: dict) -> dict:
    """What a pair's record (as ``case_faults`` wrote it before ``commits_from_logs`` kept each range
    once) still tells. Records kept only totals (``commits`` became a count), so an affected goodput
    cannot be recomputed; returns ``status``: ``exact`` (neither job can hold a re-logged range: it ran
    before re-logging existed, had no heal, or was counted from the ledger, which records
    ``commit_lines``: the figure stands), ``bound`` (only the faulty job
    can: the goodput is withdrawn and at most ``bound``, its ledger's every committed sample over the
    twin's in the window) or ``withdrawn`` (the twin healed too: no bound). ``*_in_window``: samples
    the old numerator counted in the window; ``*_committed``: the ledger's total."""
    date = pair["settings"]["date"]
    out = {"interval_s": pair["interval_s"], "repeat": pair.get("repeat", 1), "date": date, "goodput": pair["goodput"]}
    tps = pair["fault_job"]["tokens_per_sample"]
    affected = {}
    for side, key, rate_key in (("fault", "fault_job", "tokens_per_s"), ("free", "free_job", "free_tokens_per_s")):
        job = pair[key]
        out[f"{side}_in_window"] = round(pair[rate_key] * pair["window_s"] / tps)
        out[f"{side}_committed"] = job["committed_samples"]
        out[f"{side}_heals"] = job["heals"]
        affected[side] = date >= RELOGS_SINCE and job["heals"] > 0 and "commit_lines" not in job
    if not affected["fault"] and not affected["free"]:
        out["status"] = "exact"
    elif not affected["free"]:
        out["status"] = "bound"
        out["bound"] = min(pair["goodput"], out["fault_committed"] / out["free_in_window"])
    else:
        out["status"] = "withdrawn"
    return out


def recount_files(paths: Iterable[str]) -> list[dict]:
    """``recount_pair`` of every pair of every file's ``faults`` section (a folder: its
    ``goodput*.json``), printed as a table."""
    rows = []
    print("file | interval | date | goodput recorded | faulty: in window / committed (heals) | "
          "twin: in window / committed (heals) | status")
    files = [f for p in map(Path, paths) for f in (sorted(p.glob("goodput*.json")) if p.is_dir() else [p])]
    for path in files:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError(f"{path}: not a bench/goodput.py record (a JSON object of sections)")
        for pair in record.get("faults", {}).get("pairs", []):
            r = {"file": Path(path).name, **recount_pair(pair)}
            rows.append(r)
            verdict = {"exact": "stands", "withdrawn": "withdrawn, no bound (the twin healed too)",
                       "bound": f"withdrawn, at most {100 * r.get('bound', 0):.2f} %"}[r["status"]]
            print(f"{r['file']} | {_label(r['interval_s'])} | {r['date']} | {100 * r['goodput']:.2f} % | "
                  f"{r['fault_in_window'] / r['fault_committed']:.4f} ({r['fault_heals']}) | "
                  f"{r['free_in_window'] / r['free_committed']:.4f} ({r['free_heals']}) | {verdict}")
    return rows


_KIND_WORDS = {"kill": "kill", "stall": "freeze", "corrupt": "corrupted link"}


def plot(section: dict, path: str) -> None:
    """A PNG of goodput against fault interval ("none" at the right, 100 %); says so and returns
    without one when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", flush=True)
        return
    pts = sorted((p["interval_s"], 100 * p["goodput"]) for p in section["pairs"] if p["interval_s"] is not None)
    nulls = [100 * p["goodput"] for p in section["pairs"] if p["interval_s"] is None]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = sorted({x for x, _ in pts})
    kinds = " or ".join(_KIND_WORDS.get(k, k) for k in str(section["settings"].get("kinds", "kill")).split(","))
    # a line through each interval's mean, a point per repeat
    ax.plot(xs, [statistics.mean(y for x2, y in pts if x2 == x) for x in xs], "-", color="C0")
    ax.plot([x for x, _ in pts], [y for _, y in pts], "o", color="C0", label=f"a {kinds} every x s")
    for p in section["pairs"]:
        if p["interval_s"] is not None:
            f = p["fault_job"]
            ax.annotate(", ".join(f"{f[k]} {k}" for k in ("kills", "frozen", "corrupted") if f.get(k)),
                        (p["interval_s"], 100 * p["goodput"]), fontsize=7, textcoords="offset points", xytext=(4, -10))
    far = 2 * max(xs) if xs else 60
    if nulls:
        ax.plot([far] * len(nulls), nulls, "s", color="grey", label="none: fault-free vs its twin")
    ax.axhline(97.7, ls="--", lw=0.8, color="red", label="target 97.7 %")
    ax.set_xticks(xs + [far] * bool(nulls), [f"{x:g}" for x in xs] + ["none"] * bool(nulls))
    ax.set_xlabel("seconds between faults")
    ax.set_ylabel("goodput, % of fault-free")
    ax.set_title(f"{section['settings']['groups']} groups, a random group's {kinds}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)
