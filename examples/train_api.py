"""The same model through the Python API: your own loop, ``diloco.connect`` and ``diloco.DiLoCo``.

Start a coordinator, then one process per group (or ``torchrun --nproc-per-node R`` per group,
after ``torch.distributed.init_process_group``; every rank runs the same script)::

    diloco coordinator --port 29400 --groups 2 &
    export DILOCO_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
    python examples/train_api.py --coordinator 127.0.0.1:29400 --group 0 &
    python examples/train_api.py --coordinator 127.0.0.1:29400 --group 1

The lines between the two ``# --- diloco`` markers are all the glue there is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from regression import MLP, batches, mse  # noqa: E402  (the example's own model and data)

import diloco  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", required=True, help="host:port of `diloco coordinator`")
    ap.add_argument("--group", type=int, required=True, help="this group's id")
    ap.add_argument("--steps", type=int, default=200, help="inner steps")
    ap.add_argument("--h", type=int, default=20, help="inner steps between syncs")
    ap.add_argument("--codec", default="int8", help="wire codec")
    ap.add_argument("--mode", default="blocking", help="blocking, overlap, eager, delayed or co2")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(16, 32, seed=args.group)
    # --- diloco: join the job, wrap the optimizer, train, summarize ---------------------------
    link = diloco.connect(args.coordinator, group=args.group, codec=args.codec)
    with link:
        with diloco.DiLoCo(model, opt, averager=link, sync_every=args.h, mode=args.mode,
                           hook_optimizer=True) as engine:
            for step in range(args.steps):
                loss = mse(model, next(data))
                loss.backward()
                opt.step()
                opt.zero_grad()
                link.report_progress(loss=loss.item())
        summary = link.summary(engine, final_train_loss=loss.item())
    # --- diloco --------------------------------------------------------------------------------
    print(json.dumps({k: summary[k] for k in ("group", "outer_rounds", "bytes_sent", "param_hash", "final_train_loss")}))


if __name__ == "__main__":
    main()
