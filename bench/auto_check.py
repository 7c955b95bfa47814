"""`--codec auto --h auto` on a real 2-group job: what it picks on loopback and on a shaped link.

Each case is a `diloco run` (the launcher, one rank per group) with `--codec auto --h auto`; with
`--mbit R` the groups sit in network namespaces whose veths `tc tbf` shapes to R Mbit/s
(transport/netns.py, root). Prints, per case, the link the job measured, the inner step, the
setting chosen and its reason, and whether the groups' parameters ended identical.

    python bench/auto_check.py                                  # loopback, the demo GPT
    python bench/auto_check.py --mbit 2 --n-layer 6 --n-embd 512 --steps 10 --probe-bytes 65536
    # H following the link: 100 Mbit/s, then 0.5 Mbit/s from 20 s on (re-probes every 2 exchanges)
    python bench/auto_check.py --codec topk --mbit 100 --then-mbit 0.5 --after-s 20 --steps 600 \
        --probe-bytes 65536 --reprobe-every 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ itself: its transport.py would shadow the package

from diloco.job.auto_choice import AUTO, AUTO_H
from diloco.job.config import Config
from diloco.runtime.launch import launcher


def reshape(wan, mbit: float) -> None:
    """Both ends of every host's veth to ``mbit`` (what transport.netns set up at start)."""
    from transport.netns import tbf_args

    tbf = tbf_args(mbit, wan.burst_ms, wan.latency_ms)
    for host in range(len(wan.rates_mbit)):
        subprocess.run(["tc", "-n", wan.namespace(host), "qdisc", "change", "dev", "eth0", "root", *tbf], check=True)
        subprocess.run(["tc", "qdisc", "change", "dev", f"dlc{wan.tag}v{host}", "root", *tbf], check=True)
    print(f"links reshaped to {mbit:g} Mbit/s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mbit", type=float, default=None, help="shape each group's link to this (netns, root)")
    p.add_argument("--n-layer", type=int, default=Config().model.n_layer)
    p.add_argument("--n-embd", type=int, default=Config().model.n_embd)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--probe-bytes", type=int, default=Config().transport.probe_bytes,
                   help="bytes per bandwidth probe (at 2 Mbit/s: 65536; 512 KiB probes from both groups at once "
                        "queue each other's tiny probes past their 2 s resend and never finish)")
    p.add_argument("--codec", default=AUTO, help="auto, or a codec whose H alone auto chooses")
    p.add_argument("--then-mbit", type=float, default=None, help="reshape both links to this after --after-s")
    p.add_argument("--after-s", type=float, default=20.0)
    p.add_argument("--reprobe-every", type=int, default=Config().transport.reprobe_every)
    p.add_argument("--json", default="", help="write the run's summary here")
    a = p.parse_args(argv)
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd = a.n_layer, a.n_embd
    cfg.train.steps, cfg.data.eval_batches = a.steps, 2
    cfg.topology.groups, cfg.topology.ranks_per_group = 2, 1
    cfg.transport.codec, cfg.sync.h = a.codec, AUTO_H
    cfg.transport.reprobe_every = a.reprobe_every
    cfg.transport.plan_every = min(cfg.transport.plan_every, max(a.reprobe_every, 1))
    cfg.transport.timeout_s, cfg.transport.probe_bytes = 600.0, a.probe_bytes
    with tempfile.TemporaryDirectory(prefix="bench-auto-") as tmp:
        if a.mbit is None:
            s = launcher.run(cfg.validate(), run_dir=tmp, progress=False)
        else:
            from transport.netns import EmulatedWan

            cfg.transport.plaintext = True  # private namespaces made here
            with EmulatedWan([a.mbit, a.mbit]) as wan:
                placement = launcher.Placement(prefix=wan.exec_prefix, host=wan.ip, coordinator_host=wan.gateway)
                if a.then_mbit is not None:
                    threading.Timer(a.after_s, reshape, (wan, a.then_mbit)).start()
                s = launcher.run(cfg.validate(), run_dir=tmp, progress=False, placement=placement)
    auto = s["auto"]
    print(f"link {'loopback' if a.mbit is None else f'{a.mbit:g} Mbit/s (tc tbf)'}, {s['num_parameters']:,} params: "
          f"measured {8 * auto['link_bytes_per_s'] / 1e6:.3g} Mbit/s at the last decision, inner step "
          f"{1e3 * max(auto['step_s_per_group'].values()):.0f} ms (slowest group)")
    print(f"running at the end: {auto['setting']} ({auto['row']}): {auto['reason']}")
    print(f"H per round: {s['periods']}")
    print(f"params identical: {s['params_identical']}, eval loss {s['eval_loss']:.4f}, utilization "
          f"{100 * s['utilization']:.1f} %, {s['bits_per_param_per_step']:.3g} bits/param/step")
    for change in auto.get("h_changes", []):
        print(f"H -> {change['h']} at step {change['step']} (link {8 * change['link_bytes_per_s'] / 1e6:.3g} Mbit/s)")
    for change in auto.get("codec_changes", []):
        print(f"setting -> {change['setting']} at step {change['step']} "
              f"(link {8 * change['link_bytes_per_s'] / 1e6:.3g} Mbit/s)")
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1, default=str))
    return 0 if s["params_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
