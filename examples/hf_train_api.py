"""A Hugging Face causal LM trained through the Python API: your own loop, ``diloco.connect`` and ``diloco.DiLoCo``.

Start a coordinator, then one process per group (every group starts from the same seeded weights)::

    pip install -e ".[hf]"
    diloco coordinator --port 29400 --groups 2 &
    export DILOCO_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
    python examples/hf_train_api.py --coordinator 127.0.0.1:29400 --group 0 --save-pretrained /tmp/hf-api &
    python examples/hf_train_api.py --coordinator 127.0.0.1:29400 --group 1

The model comes from a ``transformers`` config (``--config``: a preset of ``diloco.integrations.hf``,
a config.json or its directory), the text from the bundled Shakespeare (or ``--data DIR``), tokens
are bytes. Group 0 writes the final global model with ``save_pretrained`` (``--save-pretrained``),
which ``AutoModelForCausalLM.from_pretrained`` reads back. The lines between the two ``# --- diloco``
markers are all the glue there is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import diloco
from diloco.demo.data import Corpus, EpochSampler, eval_batches, shard_bounds, split
from diloco.integrations import hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", required=True, help="host:port of `diloco coordinator`")
    ap.add_argument("--group", type=int, required=True, help="this group's id")
    ap.add_argument("--groups", type=int, default=2, help="groups in the job (each trains its shard of the text)")
    ap.add_argument("--config", default="llama-tiny", help="a preset, a config.json or a directory holding one")
    ap.add_argument("--data", default="", help="a directory of text files (default: the bundled Shakespeare)")
    ap.add_argument("--steps", type=int, default=100, help="inner steps")
    ap.add_argument("--h", type=int, default=25, help="inner steps between syncs")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--block", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--codec", default="int8", help="wire codec")
    ap.add_argument("--save-pretrained", default="", help="group 0 writes the final global model here")
    args = ap.parse_args()
    if args.save_pretrained and args.group == 0:
        hf.check_writable_dir(args.save_pretrained)  # a wrong path is an error now, not after training

    tokenizer = hf.ByteTokenizer()
    config = hf.load_config(args.config, vocab_size=tokenizer.vocab_size)
    tokens = hf.load_tokens(hf.text_files(args.data or None), tokenizer)
    train, val = split(Corpus(tokens, tokenizer.vocab_size, "text"), 0.05)
    lo, hi = shard_bounds(len(train), args.groups, args.group)
    data = EpochSampler(train[lo:hi], args.batch_size, args.block, seed=args.group)  # this group's shard
    model = hf.build_model(config, seed=0)  # the same initial weights in every group (checked at start)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # --- diloco: join the job, wrap the optimizer, train, summarize ---------------------------
    link = diloco.connect(args.coordinator, group=args.group, codec=args.codec)
    with link:
        with diloco.DiLoCo(model, opt, averager=link, sync_every=args.h, hook_optimizer=True) as engine:
            for step in range(args.steps):
                loss = hf.causal_lm_loss(model, next(data))
                loss.backward()
                opt.step()
                opt.zero_grad()
                link.report_progress(loss=loss.item())
        with torch.no_grad():  # the model now holds the global parameters
            model.eval()
            held_out = eval_batches(val, 8, args.block, 4)
            eval_loss = sum(hf.causal_lm_loss(model, b).item() for b in held_out) / len(held_out)
        summary = link.summary(engine, final_train_loss=loss.item(), eval_loss=eval_loss)
    # --- diloco --------------------------------------------------------------------------------
    if args.save_pretrained and args.group == 0:
        model.save_pretrained(args.save_pretrained)  # safetensors; from_pretrained reads it back
        hf.check_saved(Path(args.save_pretrained))  # transformers only logs some failures
    print(json.dumps({k: summary.get(k) for k in ("group", "outer_rounds", "bytes_sent", "param_hash", "eval_loss",
                                                  "num_parameters")}))


if __name__ == "__main__":
    main()
