"""The per-round parameter hash: `compress.fingerprint` where the parameters live, against hashing
their bytes on the host (XXH3-128 after a copy to the host: `params_digest`, what round hashes
were until 2026-11-23).

The parameters are those of the 85M-parameter GPT of issue 10 (`--n-layer 12 --n-head 12
--n-embd 768 --block-size 256`, fp32), on the CPU and, where there is one, on a GPU. Best of
--repeats, milliseconds per hash, in one run:

    python bench/fingerprint.py                      # CPU; and GPU 0 where CUDA is available
    python bench/fingerprint.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from compress.fingerprint import fingerprint  # noqa: E402
from diloco.demo.model import GPT, GPTConfig  # noqa: E402
from diloco.engine.outer_state import params_digest  # noqa: E402


def best_ms(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, n_layer=12, n_head=12, n_embd=768))  # byte-level: vocab 256
    params = [q.detach().float() for q in model.parameters()]
    n = sum(q.numel() for q in params)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    records = []
    for dev in devices:
        ps = [q.to(dev) for q in params]
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        rows = {
            "host XXH3-128 (params_digest)": lambda: params_digest(ps),
            "fingerprint": lambda: fingerprint(ps),
        }
        if dev == "cpu":
            rows["fingerprint, torch path"] = lambda: fingerprint(ps, native=False)
        base = None
        for name, fn in rows.items():
            fn()  # warm-up (keys to the device, allocator)
            ms = best_ms(fn, a.repeats, sync)
            base = base or ms
            r = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else platform.processor() or "cpu",
                 "where": dev, "hash": name, "parameters": n, "ms": ms, "gbps": n * 4 / ms / 1e6,
                 "vs_host_xxh3": base / ms}
            records.append(r)
            print(f"{dev:4s} {name:30s} {ms:9.2f} ms  {r['gbps']:6.2f} GB/s  {r['vs_host_xxh3']:5.2f} x the host hash",
                  flush=True)
        if dev == "cuda" and fingerprint(ps) != fingerprint(params):
            print("the GPU's fingerprint differs from the CPU's", file=sys.stderr)
            return 1
    if a.json:
        a.json.write_text(json.dumps({"argv": sys.argv[1:], "repeats": a.repeats, "records": records}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
