"""Peak memory per rank of a sharded (FSDP2) group against a DDP group, and bytes per rank between groups.

Memory: one group of 1, 2 and 4 ranks (Gloo on CPU, one process per rank), the demo GPT at
>= 100M parameters, AdamW inner steps and DiLoCo (H = ``--h``, one group: ``SingleGroup``), as
DDP and as FSDP2 (``fully_shard`` per block, then the root; by default built on the meta device
and initialized shard by shard, so that no rank ever holds the whole model). Each rank reports its peak RSS
(``ru_maxrss``), the RSS before the model was built, and the bytes of its parameters, gradients,
inner-optimizer state and engine state (fp32 global copy + outer momentum).

Peak RSS is ``ru_maxrss``; the ranks map every allocation of 1 MiB or more (``--mmap-threshold``)
so that freed buffers leave RSS (with glibc's default, blocks up to 32 MiB stay in the heap once
freed and RSS keeps counting them). ``rss_trace`` gives RSS and the peak so far after each phase of
the first steps and of the first sync.

Bytes: two groups of R ranks each (and a 2-rank group beside a 4-rank one), FSDP2, one blocking
fp32 sync over the real TCP transport; each rank's bytes sent against the vector's bytes / R.

    python bench/fsdp_memory.py --json bench/results/fsdp_memory.json
    python bench/fsdp_memory.py --quick            # a 6M-parameter model, to check the harness
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# bench/transport.py would shadow the transport package: import the project's, not this folder's
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
SECRET = b"bench-fsdp-memory-secret-0123456"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _optimizer_bytes(opt) -> int:
    import torch

    return sum(_tensor_bytes([_local(v)]) for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def _init_gpt(model, n_layer: int) -> None:
    """The demo GPT's initialization (``GPT.__init__``), applied to parameters that are shards."""
    import math

    import torch
    from torch import nn

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


def child(spec: dict, group: int, rank: int) -> None:
    """One rank: build, wrap, train ``steps`` steps under DiLoCo, report (JSON on stdout)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    size = spec["sizes"][group]
    folder = Path(spec["dir"])
    dist.init_process_group("gloo", store=dist.FileStore(str(folder / f"g{group}.store"), size),
                            rank=rank, world_size=size)
    from diloco.demo.model import GPT, GPTConfig
    from diloco.engine.averaging import SingleGroup
    from diloco.engine.diloco import DiLoCo
    from diloco.job.fsdp import shard_model

    before = _rss_mib()
    early = [("before the model", before, _peak_mib())]
    cfg = GPTConfig(n_layer=spec["layers"], n_embd=spec["embd"], n_head=spec["heads"], block_size=64)
    torch.manual_seed(0)
    meta = spec["parallel"] == "fsdp" and spec["fsdp_init"] == "meta"
    with torch.device("meta" if meta else "cpu"):
        model = GPT(cfg)
    numel = model.num_parameters()
    if spec["parallel"] == "fsdp":
        shard_model(model, model.blocks)
        if meta:  # no rank ever holds the whole model: allocate the shards, initialize them in place
            model.to_empty(device="cpu")
            _init_gpt(model, cfg.n_layer)
        net = model
    elif size > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        net = model
    early.append(("model built and wrapped", _rss_mib(), _peak_mib()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = {"group": group, "rank": rank, "parallel": spec["parallel"], "ranks": size, "numel": numel,
           "rss_before_model_mib": before}
    transport = None
    if spec["mode"] == "bytes":
        from transport import TcpTransport

        from diloco.exchange.striped import StripedAverager

        transport = TcpTransport(secret=SECRET, timeout_s=120)
        job = dist.FileStore(str(folder / "job.store"), sum(spec["sizes"]))
        job.set(f"addr/{group}/{rank}", transport.address)
        addresses = [[job.get(f"addr/{g}/{r}").decode() for r in range(n)] for g, n in enumerate(spec["sizes"])]

        class Members:
            groups = list(range(len(addresses)))
            ring_order = groups

            def ranks(self, g):
                return addresses[g]

        averager = StripedAverager(transport, Members(), group=group, rank=rank, timeout_s=120)
    else:
        averager = SingleGroup()
    engine = DiLoCo(model, opt, averager=averager, sync_every=spec["h"])
    gen = torch.Generator().manual_seed(group * 100 + rank)
    step_s = []
    trace = early + [("engine built", _rss_mib(), _peak_mib())]  # (after what, RSS, peak RSS so far), MiB

    def mark(what: str) -> None:
        if len(step_s) < 2 or engine.inner_step + 1 == spec["h"]:  # the first steps and the first sync
            trace.append((f"step {len(step_s)}: {what}", _rss_mib(), _peak_mib()))

    try:
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            if spec["mode"] == "bytes":  # no backward: the exchange is what is measured
                with torch.no_grad():
                    for p in model.parameters():
                        _local(p).add_(0.001)
            else:
                x = torch.randint(0, 256, (spec["batch"], 65), generator=gen)
                _, loss = net(x[:, :-1], x[:, 1:])
                mark("forward")
                loss.backward()
                mark("backward")
                opt.step()
                mark("inner step")
                opt.zero_grad(set_to_none=False)  # keep the gradients: they are part of the peak
            engine.step()
            mark("engine step")
            step_s.append(time.perf_counter() - t0)
        engine.close()
    finally:
        if transport is not None:
            transport.close()
    out.update(
        peak_rss_mib=_peak_mib(),
        param_bytes=_tensor_bytes([_local(p) for p in model.parameters()]),
        grad_bytes=_tensor_bytes([_local(p.grad) for p in model.parameters() if p.grad is not None]),
        inner_state_bytes=_optimizer_bytes(opt),
        engine_global_bytes=_tensor_bytes(engine.global_params),
        engine_outer_state_bytes=sum(_optimizer_bytes(f.optimizer) for f in engine.fragments),
        local_numel=engine.local_numel, step_s=step_s, global_hash=engine.global_hash(), rss_trace=trace,
        bytes_sent=None if transport is None else int(transport.bytes_sent),
    )
    out["engine_state_bytes"] = out["engine_global_bytes"] + out["engine_outer_state_bytes"]
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


def run(spec: dict, timeout_s: float) -> list[dict]:
    """Start every rank of ``spec`` as a process of this script; their reports."""
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as d:
        spec = {**spec, "dir": d}
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        if spec.get("mmap_threshold"):  # blocks this large are mapped and unmapped: RSS follows live memory
            env["MALLOC_MMAP_THRESHOLD_"] = str(spec["mmap_threshold"])
        procs = [subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec), str(g), str(r)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for g, n in enumerate(spec["sizes"]) for r in range(n)]
        try:
            outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, text in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"a rank failed ({p.returncode}):\n{text[-3000:]}")
        return [json.loads(line[7:]) for text in outs for line in text.splitlines() if line.startswith("RESULT ")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--h", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a 6M-parameter model (checks the harness)")
    ap.add_argument("--skip-bytes", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--mmap-threshold", type=int, default=1 << 20,
                    help="glibc's M_MMAP_THRESHOLD in the ranks (bytes; 0: glibc's default, which keeps freed "
                         "blocks of up to 32 MiB in the heap, so RSS then also counts memory freed long ago)")
    ap.add_argument("--fsdp-init", choices=("meta", "cpu"), default="meta",
                    help="FSDP: build the model on the meta device and initialize the shards (meta), or "
                         "build it whole on every rank first (cpu)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("where", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child), int(a.where[0]), int(a.where[1]))
        return
    if a.quick:
        a.layers, a.embd, a.heads = 4, 256, 4
    base = {"layers": a.layers, "embd": a.embd, "heads": a.heads, "steps": a.steps, "h": a.h, "batch": a.batch,
            "fsdp_init": a.fsdp_init, "mmap_threshold": a.mmap_threshold}
    records = []
    for parallel in () if a.skip_memory else ("ddp", "fsdp"):
        for n in (int(x) for x in a.ranks.split(",")):
            t0 = time.perf_counter()
            reps = run({**base, "parallel": parallel, "sizes": [n], "mode": "memory"}, a.timeout)
            rec = _summary(reps, "memory", time.perf_counter() - t0)
            records.append(rec)
            _write(a.json, records)
            print(f"{parallel:4s} ranks={n}: peak RSS/rank max {rec['peak_rss_mib_max']:.0f} MiB (+"
                  f"{rec['peak_growth_mib_max']:.0f} over the RSS before the model), engine state/rank "
                  f"{rec['engine_state_mib_max']:.1f} MiB, params {rec['param_mib_max']:.1f} MiB, inner state "
                  f"{rec['inner_state_mib_max']:.1f} MiB ({rec['numel']:,} parameters, {rec['seconds']:.0f} s)",
                  flush=True)
    if not a.skip_bytes:
        for sizes in ([1, 1], [2, 2], [4, 4], [2, 4]):
            t0 = time.perf_counter()
            # built whole on every rank (``fsdp_init`` cpu): the same initial parameters in both groups
            # whatever their sizes (initialized on the shards, they follow DTensor's RNG, which may not)
            reps = run({**base, "parallel": "fsdp", "sizes": sizes, "mode": "bytes", "steps": 1, "h": 1,
                        "fsdp_init": "cpu"}, a.timeout)
            rec = _summary(reps, "bytes", time.perf_counter() - t0)
            records.append(rec)
            _write(a.json, records)
            print(f"bytes {sizes}: " + ", ".join(
                f"g{r['group']}r{r['rank']} {r['bytes_sent']:,} B = {r['bytes_over_share']:.4f} x its share"
                for r in rec["per_rank"]) + f"; hashes equal: {rec['hashes_equal']}", flush=True)
    ddp = {r["ranks"]: r for r in records if r["kind"] == "memory" and r["parallel"] == "ddp"}
    for r in records:
        if r["kind"] == "memory" and r["parallel"] == "fsdp" and r["ranks"] in ddp:
            target = ddp[r["ranks"]]["engine_state_mib_max"] if r["ranks"] == 1 else ddp[1]["engine_state_mib_max"] / r["ranks"]
            r["engine_state_over_ddp_per_rank"] = r["engine_state_mib_max"] / target
            print(f"fsdp ranks={r['ranks']}: engine state per rank = {r['engine_state_over_ddp_per_rank']:.4f} x "
                  "(DDP's / ranks)")
    _write(a.json, records)


def _write(path: str | None, records: list[dict]) -> None:
    """The records so far (after every case: a failed case leaves the earlier ones)."""
    if path:
        Path(path).write_text(json.dumps(records, indent=1))


def _summary(reps: list[dict], kind: str, seconds: float) -> dict:
    mib = 2**20
    rec = {"kind": kind, "parallel": reps[0]["parallel"], "ranks": reps[0]["ranks"], "numel": reps[0]["numel"],
           "sizes": sorted({r["ranks"] for r in reps}), "seconds": seconds,
           "peak_rss_mib_max": max(r["peak_rss_mib"] for r in reps),
           "rss_before_model_mib_max": max(r["rss_before_model_mib"] for r in reps),
           "peak_growth_mib_max": max(r["peak_rss_mib"] - r["rss_before_model_mib"] for r in reps),
           "engine_state_mib_max": max(r["engine_state_bytes"] for r in reps) / mib,
           "param_mib_max": max(r["param_bytes"] for r in reps) / mib,
           "grad_mib_max": max(r["grad_bytes"] for r in reps) / mib,
           "inner_state_mib_max": max(r["inner_state_bytes"] for r in reps) / mib,
           "step_s_median": sorted(s for r in reps for s in r["step_s"])[len(reps) * len(reps[0]["step_s"]) // 2],
           "hashes_equal": len({r["global_hash"] for r in reps}) == 1, "per_rank": reps}
    if kind == "bytes":
        for r in reps:
            share = r["numel"] * 4 / r["ranks"]  # fp32, two groups: a ring sends its vector once
            r["bytes_over_share"] = r["bytes_sent"] / share
            r["bytes_over_own_shard"] = r["bytes_sent"] / (r["local_numel"] * 4)
    return rec


if __name__ == "__main__":
    main()
