"""What a fresh vector costs on the host: Δ = θ_global − θ_local over the sync bench's 19.2M-parameter
GPT (its parameter shapes), written into a new vector each time against into one written before
(the kernel faults in and zeroes a new vector's pages on first touch), one torch thread.

    python bench/fresh_vectors.py --repeats 7 --json bench/results/fresh_vectors.json
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sync_stall_report import _param_shapes  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="write the timings here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes = [p.shape for p in _param_shapes()]
    g = [torch.randn(s) for s in shapes]
    p = [torch.randn(s) for s in shapes]
    n = sum(x.numel() for x in g)
    kept = torch.empty(n)

    def delta(out: torch.Tensor) -> torch.Tensor:
        at = 0
        for a, b in zip(g, p):
            torch.sub(a, b, out=out[at:at + a.numel()].view_as(a))
            at += a.numel()
        return out

    runs: dict[str, list[tuple[float, int]]] = {"fresh": [], "kept": []}
    for _ in range(args.repeats):  # interleaved
        for kind in runs:
            f0, t0 = _faults(), time.perf_counter()
            out = delta(torch.empty(n) if kind == "fresh" else kept)
            runs[kind].append((time.perf_counter() - t0, _faults() - f0))
            del out
    record = {"parameters": n, "threads": 1, "repeats": args.repeats, "torch": torch.__version__,
              "runs": {k: [{"seconds": s, "page_faults": f} for s, f in v] for k, v in runs.items()}}
    for kind, v in runs.items():
        ms = sorted(1e3 * s for s, _ in v)
        print(f"{kind:5s}: {statistics.median(ms):.1f} ms median [{ms[0]:.1f}, {ms[-1]:.1f}], "
              f"page faults {statistics.median(f for _, f in v):,.0f} median")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
