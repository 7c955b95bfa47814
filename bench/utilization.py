"""Compute utilization and eval loss of real multi-process runs on emulated WAN links.

Every run is a real `diloco run`: a coordinator, G torchrun groups, each group in its own network
namespace whose veth link is shaped with `tc tbf` to the link rate (transport.netns). Modes:

  dp          data parallel: gradients averaged across groups every step over the same link
  blocking    DiLoCo, blocking syncs every H steps
  streaming   Streaming DiLoCo: P fragments at staggered times, each sync blocking
  overlap     Streaming DiLoCo with tau-step overlap, alpha merge and a 4-bit codec
  eager       one-outer-step eager overlap (P fragments)

Utilization = time in inner steps / wall time of the training loop (slowest group).

    python bench/utilization.py --quick                       # < 1 min
    python bench/utilization.py --json bench/results/utilization.json --plot bench/results/utilization.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diloco.job import config_parse  # noqa: E402
from diloco.job.config import Config  # noqa: E402
from diloco.runtime.launch import launcher  # noqa: E402
from transport.netns import EmulatedWan, available  # noqa: E402

MODES = {
    "dp": dict(mode="dp", codec="fp32", fragments=1),
    "blocking": dict(mode="blocking", codec="fp32", fragments=1),
    "streaming": dict(mode="blocking", codec="fp32", fragments="P"),
    "overlap": dict(mode="overlap", codec="CODEC", fragments="P"),
    "eager": dict(mode="eager", codec="fp32", fragments="P"),
}


def settings(items: list[str]) -> dict[str, dict[str, object]]:
    """``--set SECTION.KEY=VALUE`` items as a config table (VALUE read as TOML, e.g. 0.5, true, 1024;
    else taken as a string, e.g. paced)."""
    out: dict[str, dict[str, object]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot and section and name):
            raise SystemExit(f"--set {item!r}: expected SECTION.KEY=VALUE (a key of a diloco config file)")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        out.setdefault(section, {})[name] = value
    return out


def make_config(args: argparse.Namespace, mode: str, steps: int) -> Config:
    spec = MODES[mode]
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd = args.n_layer, args.n_embd
    cfg.train.steps = steps
    cfg.train.log_every = 10
    cfg.data.eval_batches = args.eval_batches
    cfg.topology.groups, cfg.topology.ranks_per_group = args.groups, 1
    cfg.sync.h = args.h
    cfg.sync.mode = spec["mode"]
    cfg.sync.fragments = args.fragments if spec["fragments"] == "P" else 1
    cfg.sync.overlap_steps = args.tau
    if args.round_seconds and mode in ("blocking", "overlap"):  # rounds by time: ceil(steps / H) rounds of S
        cfg.sync.round_seconds = args.round_seconds
    cfg.transport.codec = args.codec if spec["codec"] == "CODEC" else spec["codec"]
    if mode == "blocking" and args.blocking_codec:
        cfg.transport.codec = args.blocking_codec
    if args.outer_optimizer and mode in ("blocking", "overlap"):
        cfg.outer.optimizer = args.outer_optimizer
    if args.set and mode in ("blocking", "overlap"):
        config_parse.from_dict(settings(args.set), base=cfg)
    cfg.transport.plaintext = True  # private namespaces made by this script
    cfg.transport.timeout_s = 300.0
    return cfg.validate()


def run_one(args, mode: str, link_mbit: float | None, steps: int) -> dict:
    cfg = make_config(args, mode, steps)
    rates = [link_mbit] * args.groups
    if link_mbit is not None and args.slow_group:
        rates[-1] = link_mbit / 4
    with EmulatedWan(rates) as wan, tempfile.TemporaryDirectory(prefix="bench-util-") as tmp:
        placement = launcher.Placement(prefix=wan.exec_prefix, host=wan.ip, coordinator_host=wan.gateway)
        started = time.perf_counter()
        s = launcher.run(cfg, run_dir=tmp, progress=False, placement=placement, timeout_s=args.run_timeout)
    return {
        "mode": mode, "sync_mode": cfg.sync.mode, "codec": cfg.transport.codec,
        "outer_optimizer": cfg.outer.optimizer, "fragments": cfg.sync.fragments, "tau": cfg.sync.overlap_steps if cfg.sync.mode == "overlap" else 0,
        "h": cfg.sync.h if mode != "dp" else 1, "round_seconds": cfg.sync.round_seconds,
        **({"settings": settings(args.set)} if args.set and mode in ("blocking", "overlap") else {}),
        "inner_steps_group_0": s["inner_steps"], "tokens": s["tokens"],
        "utilization_per_group": s["utilization_per_group"], "groups": args.groups, "link_mbit": link_mbit,
        "link_mbit_per_group": rates, "steps": steps, "utilization": s["utilization"],
        "eval_loss": s["eval_loss"], "bytes_sent": s["bytes_sent"], "seconds": s["seconds"],
        "params_identical": s["params_identical"], "num_parameters": s["num_parameters"],
        "bench_seconds": time.perf_counter() - started,
    }


def table(records: list[dict]) -> str:
    lines = ["| link Mbit/s | mode | codec | P | tau | utilization | eval loss | MB sent |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['link_mbit']} | {r['mode']} | {r['codec']} | {r['fragments']} | {r['tau']} "
            f"| {100 * r['utilization']:.1f}% | {r['eval_loss']:.4f} | {r['bytes_sent'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        pts = sorted((r["link_mbit"], r["utilization"]) for r in records if r["mode"] == mode)
        if pts:
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("link rate per group (Mbit/s)")
    ax.set_ylabel("compute utilization (%)")
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("Compute utilization on emulated WAN links")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20 Mbit/s, blocking vs overlap, 40 steps (< 1 minute)")
    p.add_argument("--links", type=float, nargs="+", default=[20.0, 100.0, 1000.0], help="link rates, Mbit/s")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--steps", type=int, default=300, help="inner steps per run")
    p.add_argument("--dp-steps", type=int, default=60, help="inner steps for data parallel (slow on slow links)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--h", type=int, default=30)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--tau", type=int, default=5, help="overlap steps for mode overlap")
    p.add_argument("--codec", default="fp4-e2m1", help="codec of mode overlap")
    p.add_argument("--blocking-codec", default="", help="codec of mode blocking (default fp32)")
    p.add_argument("--outer-optimizer", default="", help="outer rule of modes blocking and overlap, e.g. sparseloco "
                   "(default: the mode's own)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--slow-group", action="store_true", help="last group's link at a quarter of the others'")
    p.add_argument("--round-seconds", type=float, default=0.0, help="modes blocking and overlap: rounds by time of "
                   "this many seconds (ceil(steps / H) of them) instead of H steps")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="modes blocking and overlap: any other setting, as a config file's key (repeatable), e.g. "
                   "--set sync.schedule=paced --set transport.zstd=true --set outer.residual_decay=0")
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    args = p.parse_args(argv)
    ok, why = available()
    if not ok:
        print(f"cannot build the emulated WAN here: {why}", file=sys.stderr)
        return 2
    if args.quick:  # the two modes the target compares, short runs
        args.links, args.modes, args.steps, args.eval_batches, args.h = [20.0], ["blocking", "overlap"], 40, 2, 20
    records = []
    for link in args.links:
        for mode in args.modes:
            steps = args.dp_steps if mode == "dp" else args.steps
            rec = run_one(args, mode, link, steps)
            records.append(rec)
            print(f"link {link:>7} Mbit/s  {mode:<9}  utilization {100 * rec['utilization']:5.1f}%  "
                  f"eval loss {rec['eval_loss']:.4f}  sent {rec['bytes_sent'] / 1e6:7.1f} MB  "
                  f"({rec['bench_seconds']:.0f} s)", flush=True)
    print(table(records))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=2))
    if args.plot:
        plot(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
