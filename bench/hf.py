"""A Hugging Face causal LM across two groups (``diloco run``, FSDP2 inside each) against the same model
trained by plain data parallel alone, at equal tokens, on the bundled Shakespeare.

DiLoCo: a real ``diloco run --entry examples.hf_causal_lm:make_task`` job (coordinator, G groups of R
ranks under torchrun, ``--parallel fsdp``); its summary gives the final eval loss of the global model,
the bytes between groups (``bytes_sent``: every rank's bytes on the wire, framing and the start's
initial-parameter check included; no bandwidth probes: ``--probe-bytes 0``), the round hashes of every
group and the data ledger (samples counted twice / left out).

Data parallel: ``dp_baseline`` below, plain PyTorch and ``transformers`` in one process, no diloco code in
the training path (model from the same config and seed, AdamW with the job's recipe: betas 0.9/0.99,
weight decay 0.1 on matrices, linear warmup then cosine to 0.1 of the peak, gradients clipped at 1.0).
One step takes the batches all G x R ranks of the DiLoCo job take at that step (the same windows of
the same shards, drawn by the job's own samplers: ``diloco.demo.data.EpochSampler``) as one batch of
G x R x B sequences: the gradient a G x R-rank DDP job averages, so the same tokens in the same steps.
Both are evaluated on the same held-out windows (the corpus tail) with the same loss.

    python bench/hf.py --json bench/results/hf.json     # the page's numbers (bench/pages/hf.md)
    python bench/hf.py --quick                          # checks the harness in about a minute
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchutil import append_record, dp_result_from  # noqa: E402
from diloco.demo import data as data_mod  # noqa: E402  (the job's samplers: the same windows)
from diloco.integrations import hf  # noqa: E402  (the config and the corpus' tokens, as the job builds them)


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup to ``peak``, then cosine to ``floor * peak`` (the job's inner schedule)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list) -> float:
    model.eval()
    value = sum(float(loss_of(model, x, y)) for x, y in batches) / len(batches)
    model.train()
    return value


def dp_baseline(a: argparse.Namespace, overrides: dict[str, str]) -> dict:
    """Data parallel over G x R ranks as one process: each step one batch of every rank's sequences."""
    tokenizer = hf.ByteTokenizer()
    config = hf.load_config(a.config, overrides, vocab_size=tokenizer.vocab_size)
    tokens = hf.load_tokens(hf.text_files(None), tokenizer)
    train, val = data_mod.split(data_mod.Corpus(tokens, tokenizer.vocab_size, "shakespeare"), a.val_fraction)
    samplers = []
    for g in range(a.groups):
        lo, hi = data_mod.shard_bounds(len(train), a.groups, g)
        samplers += [data_mod.EpochSampler(train[lo:hi], a.batch_size, a.block, seed=a.seed + 7919 * (g + 1),
                                           rank=r, group_size=a.ranks) for r in range(a.ranks)]
    held_out = data_mod.eval_batches(val, a.batch_size, a.block, a.eval_batches)
    torch.manual_seed(a.seed)
    model = hf.build_model(config, a.seed)  # = transformers.AutoModelForCausalLM.from_config(config), seeded
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.dp_lr, betas=(0.9, 0.99))
    initial = evaluate(model, held_out)
    start = time.perf_counter()
    for step in range(a.steps):
        for pg in opt.param_groups:
            pg["lr"] = lr_at(step, a.dp_lr, a.warmup, a.steps)
        pairs = [next(s) for s in samplers]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {"eval_loss": evaluate(model, held_out), "initial_eval_loss": initial, "inner_lr": a.dp_lr,
            "tokens": a.steps * len(samplers) * a.batch_size * a.block, "seconds": time.perf_counter() - start,
            "num_parameters": sum(p.numel() for p in model.parameters())}


def diloco_command(a: argparse.Namespace, json_path: str, run_dir: str) -> list[str]:
    entry_args = ",".join([f"config={a.config}", f"block={a.block}", *a.override])
    return ["diloco", "run", "--no-progress", "--entry", "examples.hf_causal_lm:make_task", "--entry-args", entry_args,
            "--groups", str(a.groups), "--ranks-per-group", str(a.ranks), "--parallel", "fsdp",
            "--steps", str(a.steps), "--h", str(a.h), "--inner-lr", str(a.lr), "--warmup-steps", str(a.warmup),
            "--batch-size", str(a.batch_size), "--eval-batches", str(a.eval_batches), "--seed", str(a.seed),
            "--val-fraction", str(a.val_fraction), "--codec", a.codec, "--probe-bytes", "0", "--timeout", "600",
            *(["--outer-lr", str(a.outer_lr)] if a.outer_lr is not None else []),
            *(["--outer-momentum", str(a.outer_momentum)] if a.outer_momentum is not None else []),
            "--json", json_path, "--run-dir", run_dir]


def run_diloco(a: argparse.Namespace) -> tuple[dict, list[str]]:
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        cmd = diloco_command(a, f"{tmp}/summary.json", f"{tmp}/run")
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run([sys.executable, "-m", "diloco", *cmd[1:]], cwd=ROOT, env=env, check=True)
        return json.loads(Path(f"{tmp}/summary.json").read_text()), cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-tiny", help="preset or config.json (diloco.integrations.hf)")
    ap.add_argument("--override", action="append", default=["config.hidden_size=128", "config.intermediate_size=344",
                                                             "config.num_hidden_layers=4"],
                    help="config.KEY=VALUE for both runs (repeat)")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per group (FSDP2 inside the group)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--h", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-3, help="DiLoCo's inner peak lr")
    ap.add_argument("--dp-lr", type=float, default=None, help="data parallel's peak lr (default --lr)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--outer-lr", type=float, default=None,
                    help="DiLoCo's outer learning rate (default: the job's, 0.7)")
    ap.add_argument("--outer-momentum", type=float, default=None, help="DiLoCo's outer Nesterov momentum "
                    "(default: the job's, 0.9)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-diloco", action="store_true", help="the data-parallel run only")
    ap.add_argument("--dp-from", default="", help="take the data-parallel result from this JSON list's record "
                    "of the same model, data and steps (data parallel has no H or codec) instead of running it")
    ap.add_argument("--quick", action="store_true", help="a tiny model, 40 steps: checks the harness")
    ap.add_argument("--json", default="", help="append the record to this JSON list")
    a = ap.parse_args()
    if a.quick:
        a.override, a.steps, a.h, a.block, a.batch_size, a.eval_batches = [], 40, 20, 32, 4, 4
    a.dp_lr = a.lr if a.dp_lr is None else a.dp_lr
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    overrides = {k[len("config."):]: v for k, v in (o.split("=", 1) for o in a.override)}
    record: dict = {"bench": "hf", "config": a.config, "overrides": overrides, "groups": a.groups, "ranks": a.ranks,
                    "steps": a.steps, "h": a.h, "batch_per_rank": a.batch_size, "block": a.block, "codec": a.codec,
                    "outer_lr": a.outer_lr, "outer_momentum": a.outer_momentum,
                    "seed": a.seed, "command": " ".join(["python", "bench/hf.py", *sys.argv[1:]]),
                    "load_average_before": os.getloadavg(), "torch": torch.__version__,
                    "transformers": hf.transformers_module().__version__}
    if a.dp_from:  # before the run: a wrong path or record costs no run
        same = ("config", "overrides", "groups", "ranks", "steps", "batch_per_rank", "block", "seed")
        reused = dp_result_from(a.dp_from, record, same, lambda r: r["dp"].get("inner_lr") == a.dp_lr)
    if not a.skip_diloco:
        s, cmd = run_diloco(a)
        hashes = list(s["round_hashes_per_group"].values())
        record["diloco"] = {
            "command": " ".join(cmd), "eval_loss": s["eval_loss"], "initial_eval_loss": s["initial_eval_loss"],
            "tokens": s["tokens"], "bytes_sent": s["bytes_sent"], "dp_bytes": s["dp_bytes"],
            "bits_per_param_per_step": s.get("bits_per_param_per_step"), "num_parameters": s["num_parameters"],
            "outer_rounds": s["outer_rounds"], "params_identical": s["params_identical"],
            "rounds_identical": all(h == hashes[0] for h in hashes), "round_hashes": hashes[0],
            "data_per_group": s["data_per_group"], "seconds": s["seconds"], "inner_lr": a.lr}
        print(json.dumps(record["diloco"], indent=1), flush=True)
    if a.dp_from:
        record["dp"] = reused
    else:
        record["dp"] = dp_baseline(a, overrides)
    print(json.dumps(record["dp"], indent=1), flush=True)
    if "diloco" in record:
        record["gap_percent"] = 100 * (record["diloco"]["eval_loss"] / record["dp"]["eval_loss"] - 1)
        assert record["diloco"]["tokens"] == record["dp"]["tokens"], "not equal tokens"
        print(f"eval loss: diloco {record['diloco']['eval_loss']:.4f}, dp {record['dp']['eval_loss']:.4f}, "
              f"gap {record['gap_percent']:+.2f} %")
    record["load_average_after"] = os.getloadavg()
    if a.json:
        append_record(a.json, record)


if __name__ == "__main__":
    main()
