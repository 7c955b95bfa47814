"""GPU profile: what syncs cost a GPU job, per mode and codec, as real ``diloco run`` jobs.

Every run is a real ``diloco run`` on this host (``diloco.runtime.launch.launcher.run``: a coordinator and G
torchrun groups of one rank, the data plane on 127.0.0.1), training the demo GPT at the size of
issue #10 (85M parameters: ``--n-layer 12 --n-head 12 --n-embd 768 --block-size 256``) for
``--steps`` inner steps at H = ``--h``. Runs:

  compute     one sync at the end (H = steps): the compute-only reference
  blocking    DiLoCo, a blocking sync every H steps (per codec)
  streaming   P = 2 fragments at staggered times, each sync blocking (fp32)
  overlap     Streaming DiLoCo, P fragments, tau-step overlap (per codec; and P = 4 int4)
  outer-cpu   blocking fp32 with the global copy on the CPU (``--outer-device cpu``)
  *-process   blocking int8 and overlap per codec again with ``--data-plane process`` (each rank's
              transport in a child process, off the trainer's interpreter lock)

Placements: ``shared`` puts every group on the first GPU (``CUDA_VISIBLE_DEVICES``); ``per-gpu``
(when the host has at least G GPUs) gives each group its own. Per run, from the groups' own
summaries (slowest group): utilization = inner-step seconds / wall seconds of the training loop,
sync seconds per round (time inside the engine's sync calls, i.e. waiting), seconds lost outside
the wait = (wall - compute-only wall of the same placement) - sync seconds: time the overlapped inner
steps themselves lost (interpreter lock, host copies, hashing), bytes sent, eval loss.

    python bench/gpu.py --json gpu.json --plot gpu.png   # a GPU host, ~15 min (commit both under bench/results)
    python bench/gpu.py --device cpu --quick          # smoke test of the bench itself on a CPU host, < 2 min

Output: a JSON list of records (``--json``) and a PNG of utilization and sync seconds per round.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diloco.job.config import Config  # noqa: E402
from diloco.runtime.launch import launcher  # noqa: E402

GPT_85M = dict(n_layer=12, n_head=12, n_embd=768, block_size=256)
TINY = dict(n_layer=4, n_head=4, n_embd=64, block_size=64)


def runs(codecs: list[str], steps: int) -> list[dict]:
    """The runs of one placement: name, sync mode, H, fragments, tau, codec, outer device."""
    out = [dict(run="compute", mode="blocking", h=steps, fragments=1, tau=0, codec="fp32")]
    out += [dict(run="blocking", mode="blocking", h=None, fragments=1, tau=0, codec=c) for c in codecs]
    out += [dict(run="streaming", mode="blocking", h=None, fragments=2, tau=0, codec="fp32")]
    out += [dict(run="overlap", mode="overlap", h=None, fragments=2, tau=None, codec=c) for c in codecs]
    out += [dict(run="overlap-p4", mode="overlap", h=None, fragments=4, tau=None, codec="int4"),
            dict(run="outer-cpu", mode="blocking", h=None, fragments=1, tau=0, codec="fp32", outer_device="cpu")]
    out += [dict(run="blocking-process", mode="blocking", h=None, fragments=1, tau=0, codec=c, data_plane="process")
            for c in codecs if c == "int8"]
    out += [dict(run="overlap-process", mode="overlap", h=None, fragments=2, tau=None, codec=c, data_plane="process")
            for c in codecs]
    return out


def make_config(a: argparse.Namespace, spec: dict) -> Config:
    cfg = Config()
    m = cfg.model
    m.n_layer, m.n_head, m.n_embd, m.block_size = (a.n_layer, a.n_head, a.n_embd, a.block_size)
    cfg.data.batch_size = a.batch_size
    cfg.data.eval_batches = 2
    cfg.train.steps = a.steps
    cfg.train.log_every = 10
    cfg.topology.groups, cfg.topology.ranks_per_group = a.groups, 1
    s = cfg.sync
    s.mode, s.fragments = spec["mode"], spec["fragments"]
    s.h = spec["h"] or a.h
    s.overlap_steps = spec["tau"] if spec["tau"] is not None else a.tau
    cfg.transport.codec = spec["codec"]
    cfg.outer.device = spec.get("outer_device", "model")
    cfg.transport.data_plane = spec.get("data_plane", "thread")
    return cfg.validate()


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_one(a: argparse.Namespace, spec: dict, visible: str) -> dict:
    cfg = make_config(a, spec)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible  # the groups' torchrun inherit it
    try:
        with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
            t0 = time.perf_counter()
            s = launcher.run(cfg, run_dir=tmp, progress=False, timeout_s=a.run_timeout)
            bench_s = time.perf_counter() - t0
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    groups = s["summaries"]  # group -> that group's own summary
    slow = max((g for g in (groups.values() if isinstance(groups, dict) else groups) if "seconds" in g),
               key=lambda g: g["seconds"])  # a group that joined too late has no time of its own
    rounds = max(1, int(s["outer_rounds"]))
    return {
        **{k: v for k, v in spec.items() if k != "h"}, "data_plane": cfg.transport.data_plane, "h": cfg.sync.h, "tau": cfg.sync.overlap_steps
        if cfg.sync.mode == "overlap" else 0, "groups": a.groups, "steps": a.steps, "visible_devices": visible,
        "placement": s.get("placement"), "num_parameters": s["num_parameters"], "eval_loss": s["eval_loss"],
        "utilization": s["utilization"], "wall_s": float(slow["seconds"]),
        "compute_s": float(slow["compute_seconds"]), "sync_s": float(slow["sync_seconds"]),
        "outer_rounds": rounds, "sync_s_per_round": float(slow["sync_seconds"]) / rounds,
        "bytes_sent": s["bytes_sent"], "bits_per_param_per_step": s["bits_per_param_per_step"],
        "params_identical": s["params_identical"], "bench_s": bench_s,
    }


def table(records: list[dict]) -> str:
    lines = ["| placement | run | codec | P | tau | utilization | of compute-only | sync s/round | lost outside wait s "
             "| MB sent | eval loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['placement_name']} | {r['run']} | {r['codec']} | {r['fragments']} | {r['tau']} "
                     f"| {100 * r['utilization']:.1f}% | {100 * r['utilization_vs_compute']:.0f}% "
                     f"| {r['sync_s_per_round']:.3f} | {r['lost_outside_wait_s']:.2f} | {r['bytes_sent'] / 1e6:.1f} "
                     f"| {r['eval_loss']:.4f} |")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['placement_name']} {r['run']} {r['codec']}" for r in records]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.3 * len(records) + 1.8), sharey=True)
    ys = range(len(records))
    axes[0].barh(ys, [100 * r["utilization"] for r in records], color="tab:green")
    axes[0].set_xlabel("compute utilization (%)")
    axes[0].set_yticks(list(ys), names, fontsize=7)
    axes[0].invert_yaxis()
    axes[1].barh(ys, [r["sync_s_per_round"] for r in records], color="tab:blue", label="sync (waiting) s/round")
    axes[1].barh(ys, [max(0.0, r["lost_outside_wait_s"]) / r["outer_rounds"] for r in records],
                 left=[r["sync_s_per_round"] for r in records], color="tab:red", label="lost outside the wait s/round")
    axes[1].set_xlabel("seconds per round")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"diloco run on {records[0]['device']}: {records[0]['num_parameters'] / 1e6:.0f}M-parameter GPT, "
                 f"H={next((r['h'] for r in records if r['run'] != 'compute'), records[0]['h'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: the GPU profile; cpu: hide the GPUs (a smoke test of this bench)")
    p.add_argument("--quick", action="store_true", help="tiny model, 24 steps at H=12, fp32 + int8 (a smoke test)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--h", type=int, default=20)
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--codecs", default="fp32,int8,int4")
    p.add_argument("--placements", default="shared,per-gpu", help="shared (all groups on GPU 0), per-gpu")
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    p.add_argument("--from-json", metavar="PATH", help="print the table (and with --plot, draw the PNG) of records "
                   "written before by --json, e.g. on a GPU host without matplotlib, and exit")
    for k, v in GPT_85M.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    a = p.parse_args(argv)
    if a.from_json:
        records = json.loads(Path(a.from_json).read_text())
        print(table(records))
        if a.plot and records:
            plot(records, a.plot)
        return 0
    if a.quick:
        a.steps, a.h, a.tau, a.codecs = 24, 12, 2, "fp32,int8"
        for k, v in TINY.items():
            setattr(a, k, v)
    n = gpu_count() if a.device == "cuda" else 0
    if a.device == "cuda" and n == 0:
        print("no CUDA device here: run on a GPU host, or --device cpu for a smoke test", file=sys.stderr)
        return 2
    placements = []
    for name in a.placements.split(","):
        if name == "shared":
            placements.append(("shared", "0" if n else ""))
        elif name == "per-gpu" and n >= a.groups:
            placements.append(("per-gpu", ",".join(str(i) for i in range(a.groups))))
        elif name == "per-gpu":
            print(f"per-gpu: {n} GPU(s) for {a.groups} groups, skipped", flush=True)
        else:
            p.error(f"unknown placement {name!r}")
    device = "cpu"
    if n:
        import torch

        device = f"{n} x {torch.cuda.get_device_name(0)}"
    records = []
    for pname, visible in placements:
        base = None
        for spec in runs(a.codecs.split(","), a.steps):
            r = run_one(a, spec, visible)
            base = base or r  # the compute-only run comes first
            r.update(placement_name=pname, device=device,
                     utilization_vs_compute=r["utilization"] / base["utilization"],
                     lost_outside_wait_s=(r["wall_s"] - base["wall_s"]) - (r["sync_s"] - base["sync_s"]))
            records.append(r)
            print(f"{pname:8s} {r['run']:16s} {r['codec']:8s} P={r['fragments']} tau={r['tau']}  utilization "
                  f"{100 * r['utilization']:5.1f}% ({100 * r['utilization_vs_compute']:.0f}% of compute-only)  "
                  f"sync {r['sync_s_per_round']:.3f} s/round  lost {r['lost_outside_wait_s']:+.2f} s  "
                  f"{r['bytes_sent'] / 1e6:.1f} MB  ({r['bench_s']:.0f} s)", flush=True)
    meta = {"argv": sys.argv[1:] if argv is None else argv, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for r in records:
        r["meta"] = meta
    print(table(records))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(records, indent=2) + "\n")
    if a.plot and records:
        plot(records, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
