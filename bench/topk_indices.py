"""What top-k's kept indices and values cost on real pseudo-gradients, and what coding them saves.

For each real vector of ``bench/codecs.py`` (pseudo-gradients of the demo GPT: ``early``, ``late``,
``outer``) and each density (k of every 4096 values), the chunk top-k that ``--codec topk`` keeps:

- index bits per kept value: the information bound ``log2(C choose k) / k``, the empirical
  entropy of the in-chunk gaps (what an ideal gap coder would spend), fixed 12-bit fields, zstd
  (level 3) over those fields, and Elias-Fano (the codec's default);
- value bits: the empirical entropy of the 2-bit level+sign fields against their 2 bits;
- the whole frame in bits per parameter, fixed and Elias-Fano;
- encode and decode time of both index codings (best of 5, one thread), in ms per million values.

    python bench/topk_indices.py                       # small model (trains in ~1 min the first time)
    python bench/topk_indices.py --size large --json bench/results/topk_indices.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import zstandard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import compress  # noqa: E402
from compress.codecs import elias_fano  # noqa: E402
from compress.codecs.packing import pack_fields, unpack_fields  # noqa: E402

CHUNK = 4096
KS = (41, 64, 123)  # 1 %, 1.56 % (SparseLoCo's 64 of 4096), 3 %


def entropy_bits(values: torch.Tensor) -> float:
    """Empirical entropy of ``values`` (ints), bits per value."""
    _, counts = values.unique(return_counts=True)
    p = counts.double() / counts.sum()
    return float(-(p * p.log2()).sum())


def kept(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-chunk indices (chunks, k) top-k keeps of the full chunks of ``x``, and the signs."""
    chunks = x.numel() // CHUNK
    view = x[: chunks * CHUNK].view(chunks, CHUNK)
    idx = view.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return idx, view.gather(1, idx) < 0


def best_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def measure(x: torch.Tensor, k: int) -> dict:
    idx, _ = kept(x, k)
    chunks = idx.shape[0]
    gaps = torch.cat([idx[:, :1], idx.diff(dim=1) - 1], dim=1)  # zeros-run before each kept value
    fixed_bytes = pack_fields(idx.reshape(-1), 12).numpy().tobytes()
    zstd_fixed = len(zstandard.ZstdCompressor(level=3).compress(fixed_bytes))
    low, bitmap = elias_fano.encode(idx, CHUNK)
    zstd_ef = len(zstandard.ZstdCompressor(level=3).compress(low.numpy().tobytes() + bitmap.numpy().tobytes()))
    n_kept = chunks * k
    ef_codec, fixed_codec = compress.get_codec("topk", k=k), compress.get_codec("topk", k=k, indices="fixed")
    frames = {"elias-fano": ef_codec.encode(x), "fixed": fixed_codec.encode(x)}
    fields = compress.get_codec("topk", k=k).quantize(x[: chunks * CHUNK])[1]
    value_fields = unpack_fields(fields, n_kept, 2)
    million = x.numel() / 1e6
    return {
        "k": k, "density": k / CHUNK, "chunks": chunks,
        "index_bits": {
            "bound": (math.lgamma(CHUNK + 1) - math.lgamma(k + 1) - math.lgamma(CHUNK - k + 1)) / math.log(2) / k,
            "gap_entropy": entropy_bits(gaps.reshape(-1)),
            "fixed": 12.0,
            "fixed_zstd": 8 * zstd_fixed / n_kept,
            "elias_fano": elias_fano.chunk_bits(CHUNK, k) / k,
            "elias_fano_zstd": 8 * zstd_ef / n_kept,
        },
        "value_bits": {"fields": 2.0, "entropy": entropy_bits(value_fields)},
        "bits_per_param": {name: 8 * len(f) / x.numel() for name, f in frames.items()},
        "ms_per_million": {
            f"{name}_{op}": ms / million
            for name, codec in (("elias-fano", ef_codec), ("fixed", fixed_codec))
            for op, ms in (("encode", best_ms(lambda c=codec: c.encode(x))),
                           ("decode", best_ms(lambda c=codec, f=frames[name]: c.decode(f))))
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("small", "large"), default="small")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from bench.codecs import cached_vectors  # the real vectors of bench/codecs.py

    vectors, info = cached_vectors(args.size)
    rows = {name: [measure(v, k) for k in KS] for name, v in vectors.items()}
    print(f"real pseudo-gradients: {info['params']:,} values ({args.size}), chunk {CHUNK}")
    print(f"{'vector':7} {'k':>4} {'bound':>6} {'gaps H':>7} {'fixed':>6} {'+zstd':>6} {'E-F':>6} {'E-F+zstd':>8} "
          f"{'val H':>6} {'bpp fixed':>9} {'bpp E-F':>8} {'dec ms/M fixed':>14} {'E-F':>6}")
    for name, results in rows.items():
        for r in results:
            ib, t = r["index_bits"], r["ms_per_million"]
            print(f"{name:7} {r['k']:>4} {ib['bound']:6.2f} {ib['gap_entropy']:7.2f} {ib['fixed']:6.2f} "
                  f"{ib['fixed_zstd']:6.2f} {ib['elias_fano']:6.2f} {ib['elias_fano_zstd']:8.2f} "
                  f"{r['value_bits']['entropy']:6.2f} {r['bits_per_param']['fixed']:9.4f} "
                  f"{r['bits_per_param']['elias-fano']:8.4f} {t['fixed_decode']:14.2f} {t['elias-fano_decode']:6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "chunk": CHUNK, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
