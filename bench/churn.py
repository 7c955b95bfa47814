"""Churn benchmark: a real `diloco run` of G groups while a chaos driver SIGKILLs them.

Every group is a real torchrun process tree on loopback (or, with --netns, in its own network
namespace: transport/netns.py). The chaos driver (diloco/runtime/launch/chaos.py) kills a random live group's
whole process tree at a random moment — inside an exchange, a vote or a heal as often as not —
and starts it again after a random pause; the restarted group heals back into the job. It
reports and asserts:

  kills, committed_rounds, rollbacks, heals, divergent_rounds (groups reporting different global
  hashes for the same committed round), hangs (the run exceeded its time limit), leaked_processes
  (anything of the run still alive afterwards), the loss (initial -> final, must go down), the
  stall survivors saw per failure (median, max: the wall time of each exchange that a failure
  disturbed — retried, or run by fewer groups than the one before), and how many committed rounds
  a restarted group took to be back in the quorum.

    python bench/churn.py --quick                                # ~3 min on 2 cores, 12 kills
    python bench/churn.py --json bench/results/churn.json        # 50+ kills
    python bench/churn.py --quorum-grace 0.5 --json bench/results/churn_grace.json   # with a grace window
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diloco.job.config import Config  # noqa: E402
from diloco.runtime.launch import launcher  # noqa: E402
from diloco.runtime.launch.chaos import ChaosMonkey  # noqa: E402
from diloco.runtime.ops.processes import processes_mentioning  # noqa: E402


def make_config(a: argparse.Namespace) -> Config:
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 32, 2, 32
    cfg.data.batch_size, cfg.data.eval_batches = 8, 4
    cfg.train.steps, cfg.train.log_every, cfg.train.seed = a.steps, 10, a.seed
    cfg.inner.warmup_steps = 20
    cfg.sync.h = a.h
    cfg.topology.groups, cfg.topology.ranks_per_group = a.groups, 1
    cfg.transport.timeout_s = a.collective_timeout
    cfg.transport.probe_bytes = 0
    cfg.fault.heartbeat_timeout = a.heartbeat_timeout
    cfg.fault.quorum_grace = getattr(a, "quorum_grace", 0.0)
    cfg.fault.max_restarts = 2
    cfg.fault.chaos = a.kills
    return cfg.validate()


def stalls(events: list[dict]) -> list[float]:
    """Seconds, from the first quorum request to the commit, of every exchange a failure disturbed
    (retried, or run by fewer groups than the one before), as the coordinator timed them."""
    return [e["seconds"] for e in events if e["kind"] == "stall"]


def heal_rounds(events: list[dict]) -> list[int]:
    """Committed rounds between a group's (re)join and its heal, per heal."""
    out, joined = [], {}
    for e in events:
        if e["kind"] == "joined":
            joined[e["group"]] = e.get("committed", 0)
        elif e["kind"] == "healed" and e["group"] in joined:
            out.append(e.get("committed", 0) - joined.pop(e["group"]))
    return out


def initial_loss(cfg: Config) -> float:
    """Eval loss of the model every group starts from (the seeded init), computed here: under
    churn every group may have been killed and healed, so none reports the start."""
    import torch

    from diloco.job.task import DEMO_ENTRY, TaskContext, build_task
    from diloco.runtime.rank.train_loop import evaluate

    ctx = TaskContext(group=0, num_groups=cfg.topology.groups, rank=0, group_size=1, device=torch.device("cpu"),
                      seed=cfg.train.seed, steps=cfg.train.steps, batch_size=cfg.data.batch_size,
                      data_path=cfg.data.path, args={}, config=cfg)
    task = build_task(DEMO_ENTRY, ctx)
    return evaluate(task.model, task, torch.device("cpu"))


def run(a: argparse.Namespace) -> dict:
    cfg = make_config(a)
    monkey = ChaosMonkey(a.kills, seed=a.seed, gap_s=(a.gap_min, a.gap_max), pause_s=(a.pause_min, a.pause_max),
                         stop_fraction=0.9)
    placement, wan = None, None
    if a.netns:
        from transport.netns import EmulatedWan

        wan = EmulatedWan([None] * a.groups).__enter__()
        placement = launcher.Placement(prefix=wan.exec_prefix, host=wan.ip, coordinator_host=wan.gateway)
        cfg.transport.plaintext = True  # private namespaces made by this script
    hangs, error = 0, None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as run_dir:
        try:
            s = launcher.run(cfg, run_dir=run_dir, progress=False, placement=placement, timeout_s=a.limit,
                             chaos=monkey)
        except launcher.LaunchError as e:
            s, error = None, str(e)
            hangs = int("exceeded its" in error)
        finally:
            if wan is not None:
                wan.close()
        leaked = processes_mentioning(run_dir)
    wall = time.perf_counter() - started
    if s is None:
        return {"error": error, "hangs": hangs, "kills": monkey.kills_done, "leaked_processes": len(leaked),
                "wall_s": wall}
    f = s["fault"]
    st = stalls(f["events"])
    healed = heal_rounds(f["events"])
    return {
        "groups": a.groups, "steps": a.steps, "h": a.h, "netns": a.netns,
        "heartbeat_timeout_s": a.heartbeat_timeout, "collective_timeout_s": a.collective_timeout,
        "quorum_grace_s": cfg.fault.quorum_grace,
        # exchanges formed without a live group once the grace window ended, and failures that were
        # not kills (a group left out while alive, then healed: its round's work lost)
        "left_out": sum(e["kind"] == "left_out" for e in f["events"]),
        "missed_exchange_failures": sum(e["kind"] == "failure" and "missed exchange" in e.get("reason", "")
                                        for e in f["events"]),
        "kills": f["kills"], "restarts": f["restarts"], "committed_rounds": f["committed"],
        "rollbacks": f["rolled_back"], "heals": f["heals"], "failures": f["failures"],
        "divergent_rounds": len(s["divergence"]), "hangs": hangs, "leaked_processes": len(leaked),
        "stall_s_median": statistics.median(st) if st else 0.0, "stall_s_max": max(st) if st else 0.0,
        "stalls": len(st), "heal_rounds_max": max(healed) if healed else None,
        "heal_rounds_median": statistics.median(healed) if healed else None,
        "initial_loss": initial_loss(cfg), "final_loss": s["eval_loss"],
        "params_identical": s["params_identical"], "wall_s": wall,
        "fault_events": [e for e in f["events"] if e["kind"] in ("failure", "left_out", "stall", "joined", "healed",
                                                                  "rolled_back", "job_lost")],
    }


HEAL_ROUNDS_TARGET = 2  # committed rounds from a restarted group's join to its heal


def check(r: dict, a: argparse.Namespace, heal_rounds_target: int = HEAL_ROUNDS_TARGET) -> list[str]:
    """The targets; returns what missed them. ``heal_rounds_target``: the most committed rounds a
    restarted group may take to be back."""
    problems = []
    if "error" in r:
        return [f"the run failed: {r['error'][-2000:]}"]
    if r["kills"] < a.kills:
        problems.append(f"only {r['kills']} of {a.kills} kills happened (the job ended first: raise --steps)")
    for key in ("divergent_rounds", "hangs", "leaked_processes"):
        if r[key]:
            problems.append(f"{key} = {r[key]}")
    if not r["params_identical"]:
        problems.append("the groups ended with different global parameters")
    if not (math.isfinite(r["final_loss"]) and r["final_loss"] < r["initial_loss"]):
        problems.append(f"the loss did not go down: {r['initial_loss']} -> {r['final_loss']}")
    bound = a.heartbeat_timeout + a.collective_timeout + 2.0  # + restart/scheduling slack on a busy host
    if r["stall_s_max"] > bound:
        problems.append(f"a survivor stalled {r['stall_s_max']:.1f}s > heartbeat + collective deadline ({bound:.1f}s)")
    if r["heal_rounds_max"] is not None and r["heal_rounds_max"] > heal_rounds_target:
        problems.append(f"a restarted group took {r['heal_rounds_max']} committed rounds to be back "
                        f"(target <= {heal_rounds_target})")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="12 kills, shorter job (about 3 minutes)")
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="inner steps (default: enough for the kills)")
    p.add_argument("--h", type=int, default=10)
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    p.add_argument("--collective-timeout", type=float, default=5.0)
    p.add_argument("--quorum-grace", type=float, default=0.0,
                   help="seconds an exchange waits for the other live groups after the first asked (0: off)")
    p.add_argument("--gap-min", type=float, default=1.5)
    p.add_argument("--gap-max", type=float, default=3.5)
    p.add_argument("--pause-min", type=float, default=0.2)
    p.add_argument("--pause-max", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--netns", action="store_true", help="each group in its own network namespace (root)")
    p.add_argument("--limit", type=float, default=0, help="seconds before the run counts as hung")
    p.add_argument("--json", help="write the result object here")
    a = p.parse_args(argv)
    if a.quick:
        a.kills = min(a.kills, 12)
    if not a.steps:  # a kill needs a restart and a heal (~5-10 s on a busy 2-core host) before the next
        a.steps = 400 * a.kills + 1000
    if not a.limit:
        a.limit = 60 + 12 * a.kills + a.steps * 0.05
    r = run(a)
    r["command"] = "python bench/churn.py " + " ".join(argv if argv is not None else sys.argv[1:])
    problems = check(r, a)
    r["ok"] = not problems
    print(json.dumps(r, indent=2))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")
    for line in problems:
        print(f"MISSED: {line}", file=sys.stderr)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
