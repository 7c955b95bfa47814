"""Benchmark every compress codec on real pseudo-gradients and on Gaussian data.

For each codec: bits per value on the wire (whole frames: header, scales and checksum included),
the same with the zstd stage, relative L2 error, and encode / decode throughput in GB/s of fp32
input on one CPU thread, next to a plain ``clone()`` of the same chunks timed in the same run.

The real pseudo-gradient is ``theta_start - theta_end`` of a fresh demo GPT after H AdamW steps
on the bundled Shakespeare corpus. The vector is cut into chunks as the transport does
(1 MiB of fp32 by default) and every chunk is one frame.

    python bench/codecs.py --quick                      # < 1 minute
    python bench/codecs.py --json bench/results/codecs.json

The blockwise codecs run their C kernels on CPU when ``compress._native`` is built
(``pip install -e .``); ``COMPRESS_NATIVE=0`` measures their pure-torch path instead.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compress  # noqa: E402
from benchutil import pin_malloc  # noqa: E402
from compress.codecs.blockwise import native_available  # noqa: E402

# codec rows: (label, name, params)
CODECS = [
    ("fp32", "fp32", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("int4", "int4", {}),
    ("fp4-e2m1", "fp4-e2m1", {}),
    ("fp4-e3m0", "fp4-e3m0", {}),
    ("sign1", "sign1", {}),
    ("topk (1.5%)", "topk", {"density": 0.015}),
]


def pseudo_gradient(steps: int, n_layer: int, n_embd: int, block: int, batch: int,
                    seed: int = 0) -> tuple[torch.Tensor, dict]:
    """theta_start - theta_end (flattened fp32) of a fresh GPT after ``steps`` AdamW steps."""
    from diloco.data import BatchSampler, load_corpus, split
    from diloco.model import GPT, GPTConfig

    torch.manual_seed(seed)
    cfg = GPTConfig(block_size=block, n_layer=n_layer, n_head=4, n_embd=n_embd)
    model = GPT(cfg)
    start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    train, _ = split(load_corpus(), 0.1)
    sampler = BatchSampler(train, batch, block, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loss = None
    for _ in range(steps):
        x, y = sampler.next()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    end = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    info = {"params": start.numel(), "inner_steps": steps, "n_layer": n_layer, "n_embd": n_embd,
            "block_size": block, "batch": batch, "optimizer": "AdamW lr=1e-3 wd=0.1",
            "final_loss": float(loss) if loss is not None else None}
    return (start - end).contiguous(), info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # no /proc (not Linux): fall back to what platform knows
        pass
    return platform.processor()


def _chunks(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    return [x[i:i + chunk] for i in range(0, x.numel(), chunk)]


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ef_error(parts: list[torch.Tensor], name: str, params: dict, rounds: int) -> float:
    """Relative L2 error of the sum of ``rounds`` decoded sends of the same vector, each chunk
    through its own ErrorFeedback: what the residual recovers over time."""
    efs = [compress.ErrorFeedback(compress.get_codec(name, **params)) for _ in parts]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in parts]
    for _ in range(rounds):
        for ef, p, t in zip(efs, parts, total):
            t += ef.encode_with_decoded(p)[1].double()
    err = sum(float((t - rounds * p.double()).square().sum()) for t, p in zip(total, parts))
    ref = sum(float((rounds * p.double()).square().sum()) for p in parts)
    return (err / ref) ** 0.5


def measure(x: torch.Tensor, chunk: int, repeats: int, with_speed: bool,
            ef_rounds: int = 10) -> list[dict]:
    """One row per codec for data ``x``; speeds are best-of-``repeats`` over all chunks."""
    parts = _chunks(x, chunk)
    nbytes = x.numel() * 4
    rows = []
    for label, name, params in CODECS:
        codec = compress.get_codec(name, **params)
        zcodec = compress.get_codec(name, zstd=True, **params)
        frames = [codec.encode(p) for p in parts]
        decoded = torch.cat([codec.decode(f) for f in frames])
        zbytes = sum(len(zcodec.encode(p)) for p in parts)
        wire = sum(len(f) for f in frames)
        row = {
            "codec": label, "name": name, "params": codec.params,
            "bits_per_value": wire * 8 / x.numel(),
            "bits_per_value_zstd": zbytes * 8 / x.numel(),
            "rel_l2_error": float((decoded - x).norm() / x.norm()),
            f"rel_l2_error_ef_{ef_rounds}_rounds": ef_error(parts, name, params, ef_rounds),
        }
        if with_speed:
            t_clone = t_enc = t_dec = float("inf")
            for _ in range(repeats):  # interleaved so that machine noise hits all three alike
                t_clone = min(t_clone, _timed(lambda: [p.clone() for p in parts]))
                t_enc = min(t_enc, _timed(lambda: [codec.encode(p) for p in parts]))
                t_dec = min(t_dec, _timed(lambda: [codec.decode(f) for f in frames]))
            row.update({
                "clone_GBps": nbytes / t_clone / 1e9,
                "encode_GBps": nbytes / t_enc / 1e9, "decode_GBps": nbytes / t_dec / 1e9,
                "encode_vs_clone": t_clone / t_enc, "decode_vs_clone": t_clone / t_dec,
            })
        rows.append(row)
    return rows


def table(real: list[dict], gauss: list[dict]) -> str:
    """Markdown table: wire size, errors on both data sets, speed ratios on real data."""
    out = ["| codec | bits/value | bits/value +zstd | rel. L2 error (real) | rel. L2 error "
           "(Gaussian) | rel. error, 10 rounds with EF (real) | encode GB/s | decode GB/s "
           "| encode / clone | decode / clone |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r, g in zip(real, gauss):
        out.append(f"| {r['codec']} | {r['bits_per_value']:.3f} | {r['bits_per_value_zstd']:.3f} "
                   f"| {r['rel_l2_error']:.4f} | {g['rel_l2_error']:.4f} "
                   f"| {r['rel_l2_error_ef_10_rounds']:.4f} "
                   f"| {r['encode_GBps']:.2f} | {r['decode_GBps']:.2f} "
                   f"| {r['encode_vs_clone']:.2f} | {r['decode_vs_clone']:.2f} |")
    clone = min(r["clone_GBps"] for r in real), max(r["clone_GBps"] for r in real)
    out.append(f"\nclone(): {clone[0]:.2f}-{clone[1]:.2f} GB/s (best per codec row)")
    return "\n".join(out)


def plot(real: list[dict], path: Path) -> None:
    """Bits/value against relative error (log-log), one point per codec."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in real:
        if r["rel_l2_error"] == 0:
            continue  # lossless (fp32) has no place on a log scale
        ax.scatter(r["bits_per_value"], r["rel_l2_error"])
        ax.annotate(r["codec"], (r["bits_per_value"], r["rel_l2_error"]),
                    fontsize=8, xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bits per value on the wire")
    ax.set_ylabel("relative L2 error (one shot, no error feedback)")
    ax.set_title("compress codecs on a real pseudo-gradient")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, few repeats (< 1 min)")
    ap.add_argument("--json", type=Path, help="write all figures to this JSON file")
    ap.add_argument("--plot", type=Path, help="write a bits-vs-error PNG here")
    ap.add_argument("--steps", type=int, default=30, help="inner AdamW steps H")
    ap.add_argument("--chunk", type=int, nargs="+", default=[1 << 18],
                    help="elements per frame (several values: one table each)")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    malloc = pin_malloc()
    if args.quick:
        size = dict(n_layer=2, n_embd=128, block=64, batch=16)
        repeats = args.repeats or 3
    else:
        size = dict(n_layer=4, n_embd=256, block=128, batch=16)
        repeats = args.repeats or 7
    t0 = time.perf_counter()
    real, info = pseudo_gradient(args.steps, **size)
    t_train = time.perf_counter() - t0
    gauss = torch.randn(real.numel(), generator=torch.Generator().manual_seed(0)) * real.std()
    print(f"pseudo-gradient: {info['params']} values after {args.steps} AdamW steps "
          f"({t_train:.1f} s); {repeats} repeats; 1 thread; malloc {malloc}; "
          f"C kernels {'on' if native_available() else 'off'}", flush=True)
    runs = []
    for chunk in args.chunk:
        rows_real = measure(real, chunk, repeats, with_speed=True)
        rows_gauss = measure(gauss, chunk, repeats, with_speed=False)
        print(f"\nframes of {chunk} values ({chunk * 4 / 2**20:g} MiB of fp32):")
        print(table(rows_real, rows_gauss), flush=True)
        runs.append({"chunk_elements": chunk, "real": rows_real, "gaussian": rows_gauss})
    result = {
        "command": "python bench/codecs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "processor": _cpu_name(), "threads": 1,
        "repeats": repeats, "malloc": malloc, "native_kernels": native_available(),
        "model": info, "runs": runs,
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(runs[0]["real"], args.plot)
    print(f"done in {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
