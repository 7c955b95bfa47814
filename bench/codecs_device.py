"""Codec throughput on the device the tensors live on (a GPU host's CUDA tensors; CPU for a smoke test).

For each codec: encode and decode of a ``--values``-long fp32 vector cut into ``--chunk``-value frames
(the transport's cut), in GB/s of fp32 input, beside a device-to-host copy of the same bytes timed in
the same run (the floor any frame that leaves the GPU pays). Encode ends with the frame's bytes on the
host; decode starts from them and ends with the values on the device.

    python bench/codecs_device.py --json bench/results/codecs_cuda.json      # a GPU host, < 1 minute
    python bench/codecs_device.py --device cpu --values 1048576               # smoke test here
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import compress  # noqa: E402
from bench.codecs import speed, timed  # noqa: E402


def measure(name: str, x: torch.Tensor, chunk: int, repeats: int) -> dict:
    """Encode / decode GB/s of one codec over ``x`` cut in ``chunk``-value frames."""
    codec = compress.get_codec(name)
    r = speed(codec, x, chunk, repeats)
    wire = sum(len(codec.encode(c)) for c in torch.split(x, chunk))
    return {"codec": name, "encode_gb_s": r["encode_GBps"], "decode_gb_s": r["decode_GBps"],
            "bits_per_value": 8 * wire / x.numel()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--values", type=int, default=1 << 26, help="fp32 values in the vector (default 256 MB)")
    p.add_argument("--chunk", type=int, default=1 << 22, help="values per frame")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--codecs", default=",".join(compress.available_codecs()))
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: --device cpu for a smoke test", file=sys.stderr)
        return 2
    x = torch.randn(a.values, generator=torch.Generator().manual_seed(0)).to(device)
    copy = min(timed(lambda: x.to("cpu"), device) for _ in range(a.repeats + 1))
    records = [{"codec": "copy-to-host", "encode_gb_s": x.numel() * 4 / 1e9 / copy, "decode_gb_s": None,
                "bits_per_value": 32.0}]
    for name in a.codecs.split(","):
        records.append(measure(name, x, a.chunk, a.repeats))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{where}, {a.values} values, frames of {a.chunk}")
    print("| codec | encode GB/s | decode GB/s | bits/value |\n|---|---|---|---|")
    for r in records:
        dec = "" if r["decode_gb_s"] is None else f"{r['decode_gb_s']:.1f}"
        print(f"| {r['codec']} | {r['encode_gb_s']:.1f} | {dec} | {r['bits_per_value']:.2f} |", flush=True)
    if a.json:
        meta = {"argv": sys.argv[1:] if argv is None else argv, "device": where, "torch": torch.__version__,
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"meta": meta, "records": records}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
