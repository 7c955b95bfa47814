"""torchtitan's debug Llama across two DiLoCo groups (2 x 2 ranks, FSDP2 inside each) against torchtitan
alone (data parallel over the same 4 ranks), at equal tokens, on the bundled Shakespeare.

DiLoCo: ``examples/titan_llama.py`` as its docstring runs it (a coordinator, one torchrun of 2 ranks per
group, ``--config llama3_debugmodel_diloco``), bandwidth probes off (``--diloco.probe_bytes 0``).
Data parallel: the same example with ``--config llama3_debugmodel_dp``: torchtitan's own ``Trainer``
(no DiLoCo code in its training path), one torchrun of 4 ranks, FSDP2 over all 4, the whole training
text. Same model, seed, optimizer, lr schedule, batch per rank and steps: the same number of tokens.

Both runs end with torchtitan's DCP checkpoint of the last step; this script loads each into a fresh
torchtitan model in one process (the model's own ``state_dict``, filled by ``torch.distributed.checkpoint
.load``) and evaluates both on the same held-out windows (the corpus tail) with the same loss. The
DiLoCo job's own evaluation (its summary's ``eval_loss``, FSDP inside the group) is recorded beside it.

Bytes between groups, two ways: the data plane's counters (the summaries' ``bytes_sent``: every rank's
bytes on the wire, framing and the start's initial-parameter check included), and the payload the
exchange has to move: per round every group sends 2(G-1)/G of the model in the codec's bytes (fp32: 4
bytes a parameter; a ring all-reduce), so G x 2(G-1)/G x 4 x N x rounds in all.

    python bench/titan.py --json bench/results/titan.json     # the page's numbers (bench/pages/titan.md)
    python bench/titan.py --quick                             # checks the harness in about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
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
from diloco.demo import data as data_mod  # noqa: E402  (the held-out windows, as the job cuts them)
from diloco.integrations import titan, titan_env  # noqa: E402

EXAMPLE = "examples/titan_llama.py"


def env() -> dict[str, str]:
    return {**os.environ, "DILOCO_SECRET": secrets.token_hex(32), "DILOCO_TOKEN": "t0ken", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def common(a: argparse.Namespace, lr: float) -> list[str]:
    return ["--optimizer.param-groups.0.optimizer-kwargs.lr", str(lr), "--training.steps", str(a.steps),
            "--training.seq_len", str(a.seq_len), "--training.local_batch_size", str(a.batch_size),
            "--checkpoint.enable", "--checkpoint.interval", str(a.steps), "--metrics.log_freq", str(max(1, a.steps // 10)),
            "--debug.seed", str(a.seed), "--dataloader.seed", str(a.seed)]


def torchrun(ranks: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), EXAMPLE, *args]


def run_diloco(a: argparse.Namespace, tmp: Path) -> dict:
    """The two-group job; each group's summary, the commands and the wall time."""
    from diloco.coordinator import CoordinatorServer

    e = env()
    with CoordinatorServer(expected_groups=a.groups, token="t0ken") as server:
        cmds = [torchrun(a.ranks, ["--diloco.coordinator", server.address, "--diloco.group", str(g),
                                   "--diloco.groups", str(a.groups), "--diloco.sync_every", str(a.h),
                                   "--diloco.codec", a.codec, "--diloco.probe_bytes", "0",
                                   "--diloco.outer_lr", str(a.outer_lr), "--diloco.outer_momentum", str(a.outer_momentum),
                                   "--diloco.eval_batches", str(a.eval_batches),
                                   "--diloco.summary_json", str(tmp / f"g{g}.json"),
                                   "--dump_folder", str(tmp / f"diloco{g}"), *common(a, a.lr)]) for g in range(a.groups)]
        start = time.perf_counter()
        procs = [subprocess.Popen(c, cwd=ROOT, env=e, stdout=open(tmp / f"g{g}.log", "w"), stderr=subprocess.STDOUT)
                 for g, c in enumerate(cmds)]
        try:
            codes = [p.wait(timeout=a.timeout) for p in procs]
        finally:
            for p in procs:
                p.kill()
        wall = time.perf_counter() - start
    if codes != [0] * a.groups:
        raise SystemExit(f"DiLoCo groups exited {codes}: {(tmp / 'g0.log').read_text()[-3000:]}")
    return {"summaries": [json.loads((tmp / f"g{g}.json").read_text()) for g in range(a.groups)],
            "commands": [" ".join(["torchrun", *c[3:]]).replace(server.address, "HOST:PORT") for c in cmds],
            "seconds": wall}


def run_dp(a: argparse.Namespace, tmp: Path) -> dict:
    """torchtitan's Trainer alone over all G x R ranks."""
    cmd = torchrun(a.groups * a.ranks, ["--config", "llama3_debugmodel_dp", "--dump_folder", str(tmp / "dp"), *common(a, a.dp_lr)])
    start = time.perf_counter()
    with open(tmp / "dp.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    if code:
        raise SystemExit(f"data parallel exited {code}: {(tmp / 'dp.log').read_text()[-3000:]}")
    return {"command": " ".join(["torchrun", *cmd[3:]]), "seconds": time.perf_counter() - start}


@torch.no_grad()
def evaluate_checkpoint(path: Path, a: argparse.Namespace) -> dict:
    """A fresh torchtitan debug Llama loaded from the DCP checkpoint at ``path``, evaluated on the held-out
    windows (mean next-token cross-entropy, nats/token)."""
    import torch.distributed.checkpoint as dcp

    titan_env.load()
    config = titan.llama3_debugmodel_diloco()
    config.training.seq_len = a.seq_len
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    torch.manual_seed(0)
    model = model_config.build()
    model.init_weights(buffer_device=None)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state)
    model.eval()
    from diloco.integrations.titan_data import corpus_splits

    _, val = corpus_splits("", 0.05)
    batches = data_mod.eval_batches(val, a.batch_size, a.seq_len, a.eval_batches)
    losses = []
    for x, y in batches:
        logits = model(x)
        losses.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"eval_loss": sum(losses) / len(losses), "num_parameters": sum(p.numel() for p in params.values()),
            "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per group (FSDP2 inside each)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--h", type=int, default=20, help="inner steps between syncs")
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--lr", type=float, default=8e-4, help="peak inner lr (torchtitan's debug config: 8e-4)")
    ap.add_argument("--dp-lr", type=float, default=None, help="data parallel's peak lr (default --lr)")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov lr (the default, DiLoCo's)")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (the default)")
    ap.add_argument("--dp-from", default="", help="take the data-parallel result from this JSON list's record of "
                    "the same model, data, steps and lr (data parallel has no H or outer step) instead of running it")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="torchtitan's seed (the initial weights, --debug.seed) and "
                    "the window order's (--dataloader.seed), for both runs")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--quick", action="store_true", help="12 steps of 32 tokens: checks the harness")
    ap.add_argument("--json", default="", help="append the record to this JSON list")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.h, a.seq_len, a.eval_batches = 12, 4, 32, 4
    a.dp_lr = a.lr if a.dp_lr is None else a.dp_lr
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    record: dict = {"bench": "titan", "config": "llama3_debugmodel_diloco / llama3_debugmodel_dp", "groups": a.groups,
                    "ranks": a.ranks, "steps": a.steps, "h": a.h, "codec": a.codec, "lr": a.lr, "dp_lr": a.dp_lr,
                    "outer_lr": a.outer_lr, "outer_momentum": a.outer_momentum, "seq_len": a.seq_len,
                    "batch_per_rank": a.batch_size, "eval_batches": a.eval_batches, "seed": a.seed,
                    "command": " ".join(["python", "bench/titan.py", *sys.argv[1:]]),
                    "load_average_before": os.getloadavg(), "torch": torch.__version__,
                    "torchtitan": titan_env.load().__version__}
    if a.dp_from:  # before the run: a wrong path or record costs no run
        same = ("groups", "ranks", "steps", "seq_len", "batch_per_rank", "eval_batches", "dp_lr")
        reused = dp_result_from(a.dp_from, record, same, lambda r: r.get("seed", 0) == a.seed)  # before --seed: 0
    with tempfile.TemporaryDirectory(prefix="bench-titan-") as tmp_name:
        tmp = Path(tmp_name)
        d = run_diloco(a, tmp)
        print(json.dumps({"diloco_seconds": d["seconds"]}), flush=True)
        if a.dp_from:
            p = reused
        else:
            p = run_dp(a, tmp)
            print(json.dumps({"dp_seconds": p["seconds"]}), flush=True)
        ours = [evaluate_checkpoint(tmp / f"diloco{g}" / "checkpoint" / f"step-{a.steps}", a) for g in range(a.groups)]
        if not a.dp_from:
            p["eval_loss"] = evaluate_checkpoint(tmp / "dp" / "checkpoint" / f"step-{a.steps}", a)["eval_loss"]
    s = d["summaries"]
    n = s[0]["num_parameters"]
    rounds = s[0]["outer_rounds"]
    payload = a.groups * 2 * (a.groups - 1) / a.groups * 4 * n * rounds  # fp32 ring all-reduce of the model
    sent = sum(x["bytes_sent"] for x in s)
    tokens = a.steps * a.groups * a.ranks * a.batch_size * a.seq_len
    record["diloco"] = {
        "commands": d["commands"], "seconds": d["seconds"],
        "eval_loss": ours[0]["eval_loss"], "eval_loss_in_job": s[0]["eval_loss"],
        "initial_eval_loss_in_job": s[0]["initial_eval_loss"],
        "checkpoints_identical": all(torch.equal(ours[0]["params"][k], o["params"][k]) for o in ours[1:] for k in o["params"]),
        "round_hashes": s[0]["round_hashes"], "rounds_identical": all(x["round_hashes"] == s[0]["round_hashes"] for x in s),
        "param_hashes": [x["param_hash"] for x in s], "outer_rounds": rounds, "num_parameters": n,
        "tokens": tokens, "tokens_in_job": sum(x["tokens"] for x in s),
        "bytes_sent_per_group": [x["bytes_sent"] for x in s], "bytes_sent": sent,
        "payload_bytes": int(payload), "bytes_over_payload": sent / payload,
        "dp_bytes": int(2 * (a.groups - 1) * 4 * n * a.steps),
        "bits_per_param_per_step": 8 * sent / (n * a.steps * a.groups)}
    assert record["diloco"]["tokens_in_job"] == tokens, "not the tokens the runs were asked for"
    record["dp"] = {**p, "tokens": tokens}
    record["gap_percent"] = 100 * (record["diloco"]["eval_loss"] / record["dp"]["eval_loss"] - 1)
    record["load_average_after"] = os.getloadavg()
    print(json.dumps({k: v for k, v in record.items()}, indent=1))
    print(f"eval loss: diloco {record['diloco']['eval_loss']:.4f}, torchtitan DP {record['dp']['eval_loss']:.4f}, "
          f"gap {record['gap_percent']:+.2f} %; bytes between groups {sent:,} (payload {int(payload):,}, "
          f"x{record['diloco']['bytes_over_payload']:.4f}); DP would send {record['diloco']['dp_bytes']:,}")
    if a.json:
        append_record(a.json, record)


if __name__ == "__main__":
    main()
