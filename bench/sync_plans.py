"""Where in a run the syncs go, at a fixed number of them: one row of the convergence study with
its sync steps planned instead of every H steps.

Runs one row of ``bench/convergence_rows.py`` in-process, as ``bench/convergence.py`` does, at the
study's learning rates (the sweep winners in ``bench/results/convergence.json``), with the same
number of syncs as the row's fixed H (so the same bits) but placed by a plan:

* ``lr:P`` -- sync density proportional to ``lr^-P`` along the inner lr's decay (its warmup left
  out: a near-zero lr there would draw all of the syncs or none): ``lr:1`` makes H proportional to
  the lr (long periods early, short ones late), ``lr:-1`` the opposite (H grows as the lr decays, as
  QSR with gamma 1 does), ``lr:0`` is the fixed H itself. ``lr:-G`` is what ``--schedule paced
  --paced-gamma G`` runs (``diloco.engine.schedule.paced_sync_steps``);
* ``two:F:S`` -- a fraction S of the syncs spread evenly over the first fraction F of the steps,
  the rest evenly over the remainder.

Each run appends ``{plan, row, size, seed, eval_loss, syncs, bits_per_param_per_step, first_h,
last_h}`` to ``--out``. The question it answers (issue 31): can the loss that a long H costs be won
back by putting the same syncs elsewhere?

    python bench/sync_plans.py --row m2-h200-outer --plan lr:1 --seed 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.convergence import DEFAULT_JSON, settings_from  # noqa: E402
from bench.convergence_rows import SIZES, study_rows  # noqa: E402
from bench.convergence_run import make_config, make_record, run_in_process  # noqa: E402
from diloco.engine.schedule import paced_sync_steps, planned_period  # noqa: E402
from diloco.runtime.rank import worker  # noqa: E402


class PlannedSyncs:
    """A sync schedule that syncs after exactly the inner-step counts in ``points`` (ascending,
    the last one the run's last step)."""

    def __init__(self, points: list[int]) -> None:
        self.points = points
        self.total_steps = points[-1]  # what a final codec needs to know its last exchange

    def period(self, step: int, lr: float) -> int:
        return planned_period(self.points, step)


def plan_points(plan: str, *, steps: int, syncs: int, lr_schedule: str = "cosine", min_ratio: float = 0.1) -> list[int]:
    """The ``syncs`` inner-step counts after which ``plan`` syncs, over a run of ``steps`` steps
    whose inner lr decays by ``lr_schedule`` (``lr:P`` is ``--schedule paced --paced-gamma -P``)."""
    kind, _, args = plan.partition(":")
    if kind == "lr":
        return list(paced_sync_steps(steps, syncs, -float(args), lr_schedule, min_ratio))
    if kind != "two":
        raise ValueError(f"unknown plan {plan!r}: lr:P or two:F:S")
    f_steps, f_syncs = (float(x) for x in args.split(":"))
    first = round(syncs * f_syncs)
    split = int(steps * f_steps)
    points = [round(split * (i + 1) / first) for i in range(first)]
    points += [split + round((steps - split) * (i + 1) / (syncs - first)) for i in range(syncs - first)]
    if len(points) != syncs or any(b <= a for a, b in zip([0, *points], points)):
        raise ValueError(f"plan {plan!r} does not give {syncs} distinct syncs over {steps} steps")
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small-xlong", choices=sorted(SIZES))
    p.add_argument("--row", default="m2-h200-outer", help="a fixed-H row of bench/convergence_rows.py")
    p.add_argument("--plan", default="lr:1", help="lr:P or two:F:S (see the module's docstring)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=str(DEFAULT_JSON), help="the study's records (its learning rates)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sync_plans.jsonl"))
    a = p.parse_args(argv)
    rows = {r.name: r for r in study_rows()}
    if a.row not in rows or rows[a.row].schedule != "fixed":
        p.error(f"{a.row!r} is not a fixed-H row of bench/convergence_rows.py")
    size, row = SIZES[a.size], rows[a.row]
    records = json.loads(Path(a.json).read_text()) if Path(a.json).exists() else []
    lrs = settings_from(records, a.size, argparse.Namespace(dp_lr=None, diloco_lr=None, outer_lr=None,
                                                            outer_momentum=None))
    cfg = make_config(size, row, a.seed, lrs)
    syncs = -(-cfg.train.steps // row.h)  # what the fixed H runs
    points = plan_points(a.plan, steps=cfg.train.steps, syncs=syncs, lr_schedule=cfg.inner.lr_schedule,
                         min_ratio=cfg.inner.min_lr_ratio)
    worker.make_schedule = lambda _cfg: PlannedSyncs(points)  # engine_options (make_engine's schedule) reads it here
    torch.set_num_threads(1)
    rec = make_record(size, row, a.seed, cfg, run_in_process(cfg))
    out = {"plan": a.plan, "row": a.row, "size": a.size, "seed": a.seed, "eval_loss": rec["eval_loss"],
           "syncs": rec["syncs"], "bits_per_param_per_step": rec["bits_per_param_per_step"],
           "first_h": points[0], "last_h": points[-1] - points[-2]}
    print(json.dumps(out), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
