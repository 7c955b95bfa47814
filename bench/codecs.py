"""Benchmark every compress codec on real pseudo-gradients and on heavy-tailed synthetic data.

For each codec: bits per value on the wire (whole frames: header, scales and checksum included),
the same with the zstd stage, relative L2 error ``||decode(encode(x)) - x|| / ||x||`` on every
vector, and encode / decode throughput in GB/s of fp32 input on one CPU thread, next to a plain
``clone()`` of the same chunks timed in the same run. Every vector is cut into chunks as the
transport does (1 MiB of fp32 by default) and every chunk is one frame.

Real vectors (``diloco_vectors``): pseudo-gradients of a short DiLoCo run of the demo GPT on the
bundled Shakespeare corpus, as the demo trains it (2 groups, H = 30 AdamW steps per round, outer
Nesterov), at two sizes (2 layers d=128: 437,760 values; 4 layers d=256: 3,257,856 values):
``early`` (round 1, fresh model), ``late`` (the last round, after 570 / 270 steps) and ``outer``
(the last round's outer-momentum-applied update Delta + 0.9 v). They are cached in a .cache
folder beside this script (git-ignored; the larger model takes 5-10 minutes on 2 CPU cores).
Synthetic vectors: Gaussian, Student-t with 3 degrees of freedom, Laplace, and Gaussian with
0.1 % of the values times 100.

    python bench/codecs.py --quick                      # small model only, < 2 minutes
    python bench/codecs.py --json bench/results/codecs.json
    python bench/codecs.py --compare bench/results/codecs-before.json bench/results/codecs.json
    python bench/codecs.py --design-lloyd4              # re-derive lloyd4's levels

``--ablation`` adds the 4-bit variants that were measured before choosing (scale search off,
other search windows, block sizes, stochastic rounding). ``--compress-root DIR`` imports
``compress`` from another checkout (e.g. an older commit, to measure "before"). The blockwise
codecs run their C kernels on CPU when ``compress._native`` is built (``pip install -e .``);
``COMPRESS_NATIVE=0`` measures their pure-torch path instead.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--compress-root" in sys.argv[1:-1]:  # before importing compress: another checkout's
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--compress-root") + 1]).resolve()))

from benchutil import pin_malloc  # noqa: E402

import compress  # noqa: E402
from compress.codecs.blockwise import native_available  # noqa: E402

FOUR_BIT = ["int4", "fp4-e2m1", "fp4-e3m0", "lloyd4"]
# codec rows: (label, name, params)
CODECS = [
    ("fp32", "fp32", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("int4", "int4", {}),
    ("fp4-e2m1", "fp4-e2m1", {}),
    ("fp4-e3m0", "fp4-e3m0", {}),
    ("lloyd4", "lloyd4", {}),
    ("int2", "int2", {}),
    ("int2 block 1024", "int2", {"block_size": 1024}),
    ("sign1", "sign1", {}),
    ("sign1 block 1024", "sign1", {"block_size": 1024}),
    ("topk (1.5%)", "topk", {"density": 0.015}),
]
# 4-bit variants measured before choosing: (label, name, params, search window or None)
ABLATION = [
    *[(f"{n}{label}", n, params, None) for n in ("int4", "fp4-e2m1", "lloyd4") for label, params in (
        (" no search", {"search": False}), ("", {}), (" block 16", {"block_size": 16}),
        (" block 64", {"block_size": 64}), (" block 128", {"block_size": 128}),
        (" stochastic", {"stochastic": True, "seed": 0}))],
    *[(f"fp4-e3m0{label}", "fp4-e3m0", params, window) for label, params, window in (
        (" no search", {"search": False}, None), (" search k0-1..k0+1", {}, (1, 1)),
        (" search k0-2..k0+2", {}, (2, 2)), ("", {}, None), (" block 64", {"block_size": 64}, None),
        (" stochastic", {"stochastic": True, "seed": 0}, None))],
    ("int4 search k0..k0+1", "int4", {}, (0, 1)), ("int4 search k0-2..k0+1", "int4", {}, (2, 1)),
]


CACHE = Path(__file__).resolve().parent / ".cache"

#: model sizes of the real vectors: (n_layer, n_embd, block, batch, outer rounds)
SIZES = {"small": (2, 128, 64, 16, 20), "large": (4, 256, 128, 16, 10)}


def diloco_vectors(n_layer: int, n_embd: int, block: int, batch: int, rounds: int, *,
                   groups: int = 2, inner: int = 30, seed: int = 0) -> tuple[dict, dict]:
    """Pseudo-gradients of a short DiLoCo run of the demo GPT, as the demo trains it.

    ``groups`` workers, each on its own shard of the bundled Shakespeare corpus with its own
    AdamW (lr 1e-3 peak, 20 warmup steps, cosine to 0.1 x over the run, weight decay 0.1,
    gradient clipping at 1.0; state kept across rounds), ``inner`` steps per round, outer
    Nesterov (lr 0.7, momentum 0.9) on the mean pseudo-gradient. Returns (vectors, info) with
    vectors (flattened fp32):

    - ``early``: group 0's pseudo-gradient ``theta_global - theta_local`` of round 1 (fresh model);
    - ``late``: group 0's pseudo-gradient of the last round;
    - ``outer``: the last round's outer update direction ``Delta + momentum * v`` (v the Nesterov
      buffer after that round's ``v <- momentum * v + Delta``, Delta the mean pseudo-gradient):
      what the outer step subtracts, times its lr.
    """
    from torch.nn.utils import parameters_to_vector

    from diloco.demo.data import BatchSampler, load_corpus, shard_bounds, split
    from diloco.demo.model import GPT, GPTConfig
    from diloco.engine.schedule import inner_lr

    train, _ = split(load_corpus(), 0.1)
    cfg = GPTConfig(block_size=block, n_layer=n_layer, n_head=4, n_embd=n_embd)
    torch.manual_seed(seed)
    models = [GPT(cfg)]
    models += [GPT(cfg) for _ in range(groups - 1)]
    theta = parameters_to_vector(models[0].parameters()).detach().clone()
    opts, samplers = [], []
    for g, m in enumerate(models):
        lo, hi = shard_bounds(len(train), groups, g)
        samplers.append(BatchSampler(train[lo:hi], batch, block, seed + 7919 * (g + 1)))
        opts.append(torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1))
    total = rounds * inner
    v = torch.zeros_like(theta)
    out, losses = {}, []
    for r in range(rounds):
        deltas = []
        for m, opt, sampler in zip(models, opts, samplers):
            with torch.no_grad():  # copy (vector_to_parameters would alias theta)
                off = 0
                for p in m.parameters():
                    p.copy_(theta[off:off + p.numel()].view_as(p))
                    off += p.numel()
            for h in range(inner):
                lr = inner_lr(r * inner + h, peak=1e-3, warmup_steps=20, total_steps=total)
                for pg in opt.param_groups:
                    pg["lr"] = lr
                x, y = sampler.next()
                _, loss = m(x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
            deltas.append(theta - parameters_to_vector(m.parameters()).detach())
            losses.append(loss.item())
        delta = torch.stack(deltas).mean(dim=0)
        v.mul_(0.9).add_(delta)
        update = delta + 0.9 * v
        theta -= 0.7 * update
        if r == 0:
            out["early"] = deltas[0].clone()
    out["late"] = deltas[0].clone()
    out["outer"] = update.clone()
    info = {"params": theta.numel(), "n_layer": n_layer, "n_embd": n_embd, "block_size": block,
            "batch": batch, "groups": groups, "inner_steps": inner, "rounds": rounds,
            "inner_optimizer": "AdamW lr 1e-3 (20 warmup, cosine to 1e-4), wd 0.1, clip 1.0",
            "outer_optimizer": "Nesterov lr 0.7 momentum 0.9",
            "first_loss": losses[0], "final_loss": losses[-1]}
    return {k: t.contiguous() for k, t in out.items()}, info


def cached_vectors(size: str, seed: int = 0) -> tuple[dict, dict]:
    """``diloco_vectors`` of a named size, cached in the .cache folder beside this script
    (git-ignored by its own .gitignore) because the larger model takes minutes on CPU."""
    n_layer, n_embd, block, batch, rounds = SIZES[size]
    path = CACHE / f"diloco-{n_layer}x{n_embd}-b{block}-r{rounds}-s{seed}.pt"
    if path.exists():
        blob = torch.load(path, weights_only=True)
        return blob["vectors"], blob["info"]
    t0 = time.perf_counter()
    vectors, info = diloco_vectors(n_layer, n_embd, block, batch, rounds, seed=seed)
    info["train_seconds"] = time.perf_counter() - t0
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / ".gitignore").write_text("*\n")
    torch.save({"vectors": vectors, "info": info}, path)
    return vectors, info


def synthetic_vectors(n: int, seed: int = 0) -> dict:
    """Heavy-tailed (and Gaussian) test data of ``n`` values each, fixed seeds."""
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(n, generator=g)
    chi2 = torch.randn(3, n, generator=g).square().sum(0)  # Student-t, 3 dof: z / sqrt(chi2_3 / 3)
    student = torch.randn(n, generator=g) / (chi2 / 3).sqrt()
    u = torch.rand(n, generator=g) - 0.5
    laplace = -u.sign() * torch.log1p(-2 * u.abs())
    outliers = torch.randn(n, generator=g)
    pick = torch.randperm(n, generator=g)[: max(1, n // 1000)]
    outliers[pick] *= 100.0
    return {"gaussian": gauss, "student-t3": student, "laplace": laplace,
            "gauss+0.1%x100": outliers}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # no /proc (not Linux): fall back to what platform knows
        pass
    return platform.processor()


def vectors(quick: bool, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """name -> fp32 vector (real ones first), and what produced the real ones."""
    out, info = {}, {}
    for size in (("small",) if quick else ("small", "large")):
        vs, meta = cached_vectors(size, seed)
        info[size] = meta
        out.update({f"{size}/{k}": v for k, v in vs.items()})
    out.update(synthetic_vectors(1 << (18 if quick else 20), seed))
    return out, info


def _chunks(x: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    return [x[i:i + chunk] for i in range(0, x.numel(), chunk)]


def timed(fn, device: torch.device | None = None) -> float:
    """Seconds of ``fn()``, until the work it queued on a CUDA ``device`` is done."""
    t = time.perf_counter()
    fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def rel_error(codec, x: torch.Tensor, chunk: int) -> float:
    """||decode(encode(x)) - x|| / ||x|| with one frame per chunk (fp64 sums)."""
    err = sum(float((codec.decode(codec.encode(p)).double() - p.double()).square().sum())
              for p in _chunks(x, chunk))
    return (err / float(x.double().square().sum())) ** 0.5


def ef_error(parts: list[torch.Tensor], codec_of, rounds: int) -> float:
    """Relative L2 error of the sum of ``rounds`` decoded sends of the same vector, each chunk
    through its own ErrorFeedback: what the residual recovers over time."""
    efs = [compress.ErrorFeedback(codec_of()) for _ in parts]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in parts]
    for _ in range(rounds):
        for ef, p, t in zip(efs, parts, total):
            t += ef.encode_with_decoded(p)[1].double()
    err = sum(float((t - rounds * p.double()).square().sum()) for t, p in zip(total, parts))
    ref = sum(float((rounds * p.double()).square().sum()) for p in parts)
    return (err / ref) ** 0.5


def speed(codec, x: torch.Tensor, chunk: int, repeats: int) -> dict:
    """Best-of-``repeats`` encode / decode GB/s over all chunks, interleaved with clone(). On a GPU
    tensor, decode writes the values back to its device and every timing waits for the device."""
    parts = _chunks(x, chunk)
    frames = [codec.encode(p) for p in parts]
    nbytes = x.numel() * 4
    dev = x.device if x.device.type != "cpu" else None
    t_clone = t_enc = t_dec = float("inf")
    for _ in range(repeats):  # interleaved so that machine noise hits all three alike
        t_clone = min(t_clone, timed(lambda: [p.clone() for p in parts], dev))
        t_enc = min(t_enc, timed(lambda: [codec.encode(p) for p in parts], dev))
        t_dec = min(t_dec, timed(lambda: [codec.decode(f, device=dev) for f in frames], dev))
    return {"clone_GBps": nbytes / t_clone / 1e9, "encode_GBps": nbytes / t_enc / 1e9,
            "decode_GBps": nbytes / t_dec / 1e9, "encode_vs_clone": t_clone / t_enc,
            "decode_vs_clone": t_clone / t_dec}


def make_codec(name: str, params: dict, window=None):
    codec = compress.get_codec(name, **params)
    if window is not None:
        codec.window = window  # bench only: another search window on this instance
    return codec


def measure(data: dict[str, torch.Tensor], speed_key: str, chunk: int, repeats: int,
            rows: list, ef_rounds: int = 10, with_ef: bool = True) -> list[dict]:
    """One result per codec row that this ``compress`` has: wire size and speed on
    ``data[speed_key]``, relative error on every vector."""
    names = set(compress.available_codecs())
    x = data[speed_key]
    out = []
    for row in rows:
        label, name, params = row[:3]
        window = row[3] if len(row) > 3 else None
        try:
            codec = make_codec(name, params, window)
        except ValueError as e:  # a codec or parameter this compress does not have ("before" runs)
            print(f"skipping {label}: {e}", file=sys.stderr)
            continue
        if name not in names:
            continue
        frames = [codec.encode(p) for p in _chunks(x, chunk)]
        zcodec = make_codec(name, {**params, "zstd": True}, window)
        r = {"codec": label, "name": name, "params": codec.params, "window": window,
             "bits_per_value": sum(len(f) for f in frames) * 8 / x.numel(),
             "bits_per_value_zstd": sum(len(zcodec.encode(p)) for p in _chunks(x, chunk)) * 8
             / x.numel(),
             "rel_l2_error": {k: rel_error(codec, v, chunk) for k, v in data.items()}}
        if with_ef:
            r[f"rel_l2_error_ef_{ef_rounds}_rounds"] = ef_error(
                _chunks(x, chunk), lambda: make_codec(name, params, window), ef_rounds)
        r.update(speed(codec, x, chunk, repeats))
        out.append(r)
        print(f"  {label}: {r['bits_per_value']:.3f} bits/value, encode {r['encode_GBps']:.2f} GB/s, "
              f"error " + " ".join(f"{v:.4f}" for v in r["rel_l2_error"].values()), flush=True)
    return out


def _fmt(v: float) -> str:
    return f"{100 * v:.2f}"


def error_table(rows: list[dict], keys: list[str], speed_cols: bool) -> str:
    """Markdown: bits/value, relative error (%) per vector, then speed (if asked)."""
    head = ["codec", "bits/value"] + [f"{k} %" for k in keys]
    if speed_cols:
        head += ["bits +zstd", "10 rounds EF %", "encode GB/s", "decode GB/s", "enc / clone",
                 "dec / clone"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["codec"], f"{r['bits_per_value']:.3f}"]
        cells += [_fmt(r["rel_l2_error"][k]) for k in keys]
        if speed_cols:
            ef = r.get("rel_l2_error_ef_10_rounds")
            cells += [f"{r['bits_per_value_zstd']:.3f}", _fmt(ef) if ef is not None else "",
                      f"{r['encode_GBps']:.2f}", f"{r['decode_GBps']:.2f}",
                      f"{r['encode_vs_clone']:.2f}", f"{r['decode_vs_clone']:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def compare_table(before: dict, after: dict) -> str:
    """Markdown: per codec present in both, before -> after relative error (%) per vector, bits
    per value and speed."""
    b_rows = {r["codec"]: r for r in before["rows"]}
    keys = [k for k in after["rows"][0]["rel_l2_error"] if k in before["rows"][0]["rel_l2_error"]]
    head = ["codec", "bits/value"] + [f"{k} %" for k in keys] + ["encode GB/s", "decode GB/s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in after["rows"]:
        b = b_rows.get(r["codec"])
        if b is None or r["name"] not in FOUR_BIT + ["int8"]:
            continue
        cells = [r["codec"], f"{b['bits_per_value']:.3f} → {r['bits_per_value']:.3f}"]
        cells += [f"{_fmt(b['rel_l2_error'][k])} → **{_fmt(r['rel_l2_error'][k])}**" for k in keys]
        cells += [f"{b['encode_GBps']:.2f} → {r['encode_GBps']:.2f}",
                  f"{b['decode_GBps']:.2f} → {r['decode_GBps']:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def design_lloyd4(iters: int = 60, n: int = 1 << 18, seed: int = 123) -> list[float]:
    """lloyd4's levels: Lloyd-Max for N(0, 1) data under the codec's own block format. Alternates
    the encoder (blocks of 32, scale search, nearest level) with the centroid update (each level
    becomes the scale-weighted mean of the magnitudes it took: sum(u |x|) / sum(u^2)), top level
    fixed at 7, starting from int4's uniform levels."""
    from compress.codecs.block4 import GROUP, Lloyd4

    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    levels = tuple(float(v) for v in range(8))
    for _ in range(iters):
        codec = Lloyd4()
        codec.levels = levels  # this instance only
        anchors, scodes, codes = codec.quantize(x)
        u = anchors.repeat_interleave(GROUP)[:scodes.numel()] * codec._tables(x.device)["U"][scodes.long()]
        u = u.double().repeat_interleave(codec.block_size)[:n]
        nib = torch.stack([codes & 15, codes >> 4], 1).reshape(-1)[:n].long()
        m = nib & 7
        num = torch.zeros(8, dtype=torch.float64).index_add_(0, m, u * x.double().abs())
        den = torch.zeros(8, dtype=torch.float64).index_add_(0, m, u * u)
        new = num / den.clamp(min=1e-300)
        levels = tuple(0.0 if i == 0 else round(float(v / new[7] * 7), 3) for i, v in enumerate(new))
    return list(levels)


def plot(rows: list[dict], keys: list[str], path: Path) -> None:
    """Bits/value against the mean relative error over the real vectors (log-log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        err = sum(r["rel_l2_error"][k] for k in keys) / len(keys)
        if err == 0:
            continue  # lossless (fp32) has no place on a log scale
        ax.scatter(r["bits_per_value"], err)
        dy = {"fp4-e2m1": 8, "int4": -1, "lloyd4": -10}.get(r["name"], 2)  # 4-bit ones sit together
        ax.annotate(r["codec"], (r["bits_per_value"], err), fontsize=8, xytext=(4, dy),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bits per value on the wire")
    ax.set_ylabel("relative L2 error (mean over the real vectors)")
    ax.set_title("compress codecs on DiLoCo pseudo-gradients")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model only, 2^18 synthetic values")
    ap.add_argument("--json", type=Path, help="write all figures to this JSON file")
    ap.add_argument("--plot", type=Path, help="write a bits-vs-error PNG here")
    ap.add_argument("--chunk", type=int, default=1 << 18, help="elements per frame")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--ablation", action="store_true", help="also the 4-bit variants")
    ap.add_argument("--compress-root", type=Path, help="import compress from this checkout")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"),
                    help="print a before/after table of two --json results and exit")
    ap.add_argument("--design-lloyd4", action="store_true", help="print lloyd4's levels and exit")
    args = ap.parse_args(argv)

    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        print(compare_table(before, after))
        return 0
    if args.design_lloyd4:
        print(design_lloyd4())
        return 0
    torch.set_num_threads(1)
    malloc = pin_malloc()
    repeats = args.repeats or (3 if args.quick else 7)
    t0 = time.perf_counter()
    data, info = vectors(args.quick)
    speed_key = "small/late" if args.quick else "large/late"
    real = [k for k in data if "/" in k]
    synthetic = [k for k in data if "/" not in k]
    print(f"{len(data)} vectors ({time.perf_counter() - t0:.1f} s); speed on {speed_key} "
          f"({data[speed_key].numel()} values), {repeats} repeats; 1 thread; malloc {malloc}; "
          f"C kernels {'on' if native_available() else 'off'}; compress from "
          f"{Path(compress.__file__).parent}", flush=True)
    rows = measure(data, speed_key, args.chunk, repeats, CODECS)
    print(f"\nframes of {args.chunk} values; real pseudo-gradients:")
    print(error_table(rows, real, speed_cols=True))
    print("\nsynthetic:")
    print(error_table(rows, synthetic, speed_cols=False))
    ablation = []
    if args.ablation:
        print("\n4-bit variants:", flush=True)
        ablation = measure(data, speed_key, args.chunk, max(1, repeats // 2), ABLATION,
                           with_ef=False)
        print(error_table(ablation, real + synthetic, speed_cols=False))
        print("\n" + "\n".join(f"{r['codec']}: encode {r['encode_GBps']:.2f} GB/s, decode "
                               f"{r['decode_GBps']:.2f} GB/s" for r in ablation))
    result = {
        "command": "python bench/codecs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "processor": _cpu_name(), "threads": 1,
        "repeats": repeats, "malloc": malloc, "native_kernels": native_available(),
        "chunk_elements": args.chunk, "speed_vector": speed_key,
        "vectors": {k: v.numel() for k, v in data.items()}, "models": info,
        "rows": rows, "ablation": ablation, "seconds": time.perf_counter() - t0,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(rows, real, args.plot)
    print(f"done in {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
