"""How stale error feedback's residual is: one row of the convergence study, every exchange traced.

Runs one row of ``bench/convergence_rows.py`` in-process, as ``bench/convergence.py`` does, at the
study's learning rates (the sweep winners in ``bench/results/convergence.json``), and prints for
each exchange of each group: the norm of its fresh pseudo-gradient Δ, of the residual e it adds
(``y = Δ + β·e``), their cosine, and the part of y the exchange did not deliver; then the global
model's eval loss along the run. A residual as large as Δ and orthogonal to it is error from an
older model, sent into a newer one.

    python bench/residual_staleness.py --size small --row m2-h230-int2b1024-int4final-outer
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.convergence import DEFAULT_JSON, settings_from  # noqa: E402
from bench.convergence_rows import SIZES, study_rows  # noqa: E402
from bench.convergence_run import make_config, run_in_process  # noqa: E402
from diloco.engine import error_feedback  # noqa: E402


def traced(lock: threading.Lock):
    """``Residuals.start`` that prints |Δ|, |e| and their cosine, and ``land`` that prints what
    the exchange did not deliver, before doing what they do."""
    start, land = error_feedback.Residuals.start, error_feedback.Residuals.land

    def traced_start(self, averager, p, delta, *, tag, **kw):
        e = self.residual[p]
        cos = 0.0 if e is None else float(torch.nn.functional.cosine_similarity(delta.float(), e, dim=0))
        with lock:
            print(f"{threading.current_thread().name:>8} {tag:>7}: |delta| {float(delta.norm()):8.4f}  "
                  f"|e| {0.0 if e is None else float(e.norm()):8.4f}  cos(delta, e) {cos:+.3f}", flush=True)
        return start(self, averager, p, delta, tag=tag, **kw)

    def traced_land(self, p, y, sent):
        with lock:
            print(f"{'':>17}  not delivered: |y - sent| / |y| {float((y - sent).norm() / y.norm()):.3f}", flush=True)
        return land(self, p, y, sent)

    return traced_start, traced_land


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--row", default="m2-h230-int2b1024-int4final-outer", help="a row of bench/convergence_rows.py")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=str(DEFAULT_JSON), help="the study's records (its learning rates)")
    a = p.parse_args(argv)
    rows = {r.name: r for r in study_rows()}
    if a.row not in rows:
        p.error(f"unknown row {a.row!r}")
    records = json.loads(Path(a.json).read_text()) if Path(a.json).exists() else []
    lrs = settings_from(records, a.size, argparse.Namespace(dp_lr=None, diloco_lr=None, outer_lr=None,
                                                            outer_momentum=None))
    torch.set_num_threads(1)
    error_feedback.Residuals.start, error_feedback.Residuals.land = traced(threading.Lock())
    result = run_in_process(make_config(SIZES[a.size], rows[a.row], a.seed, lrs))
    print(f"eval loss {result['eval_loss']:.4f}; along the run: "
          + ", ".join(f"{c['step']}: {c['eval_loss']:.3f}" for c in result.get("curve", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
