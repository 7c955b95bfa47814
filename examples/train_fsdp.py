"""A model sharded inside each group with FSDP2, trained with DiLoCo across groups (the Python API).

Every rank holds only its shard of the parameters, of the inner optimizer's state, of the engine's
fp32 global copy and of the outer momentum; each rank exchanges its shard with the ranks of the
other groups that hold the same elements. Groups may have different numbers of ranks. Start a
coordinator, then one ``torchrun`` per group (every rank runs this script)::

    diloco coordinator --port 29400 --groups 2 &
    export DILOCO_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --coordinator 127.0.0.1:29400 --group 0 &
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py --coordinator 127.0.0.1:29400 --group 1

On GPUs use ``--backend nccl`` (each rank on ``cuda:LOCAL_RANK``). The lines between the two
``# --- diloco`` markers are all the glue there is; ``diloco run --parallel fsdp`` does the same
for ``--entry`` models and the demo GPT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

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
    ap.add_argument("--backend", default="gloo", help="torch.distributed backend inside the group")
    args = ap.parse_args()

    dist.init_process_group(args.backend)  # torchrun's environment: this group's ranks
    rank = dist.get_rank()
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)  # the same initial weights in every group (checked at start)
    model = MLP(width=256)
    if args.backend == "nccl":
        model = model.cuda()
    device = next(model.parameters()).device
    # --- diloco: shard in the group, join the job, wrap the optimizer, train, summarize ---------
    diloco.shard_model(model, ["inp", "hidden.1", "out"])  # fully_shard each layer, then the root
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # over the shards
    link = diloco.connect(args.coordinator, group=args.group, codec=args.codec)
    data = batches(16, 32, seed=1000 * args.group + rank)  # every rank of every group: its own data
    with link:
        with diloco.DiLoCo(model, opt, averager=link, sync_every=args.h, mode=args.mode,
                           hook_optimizer=True) as engine:
            for step in range(args.steps):
                x, y = next(data)
                loss = mse(model, (x.to(device), y.to(device)))
                loss.backward()
                opt.step()
                opt.zero_grad()
                link.report_progress(loss=loss.item())
        held_out = next(batches(16, 256, seed=99))
        with torch.no_grad():  # the model now holds the global parameters; every rank evaluates
            eval_loss = mse(model, (held_out[0].to(device), held_out[1].to(device))).item()
        summary = link.summary(engine, final_train_loss=loss.item(), eval_loss=eval_loss)
    # --- diloco --------------------------------------------------------------------------------
    if rank == 0:
        print(json.dumps({k: summary.get(k) for k in ("group", "outer_rounds", "bytes_sent", "param_hash",
                                                      "eval_loss", "num_parameters")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
