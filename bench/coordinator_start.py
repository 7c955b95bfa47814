"""Seconds from starting ``diloco coordinator --port 0`` to its "listening" line: how soon a
(re)started coordinator serves. With ``--before DIR`` (another checkout, e.g. ``git worktree add
/tmp/before REV``) the two alternate in one run, so the ratio holds on a shared machine; without it,
the time a bare ``import torch`` takes is the baseline beside it.

    python bench/coordinator_start.py
    python bench/coordinator_start.py --before /tmp/before --runs 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def coordinator_start_s(root: Path) -> float:
    """One start of the coordinator from ``root``'s packages, to its first line."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("DILOCO_TOKEN", None)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "coordinator", "--host", "127.0.0.1", "--port", "0",
                             "--groups", "1"], stdout=subprocess.PIPE, text=True, cwd=root, env=env)
    try:
        first = proc.stdout.readline()
        took = time.perf_counter() - started
        if "listening on" not in first:
            raise SystemExit(f"{root}: unexpected first line {first!r}")
        return took
    finally:
        proc.terminate()
        proc.wait(10)


def torch_import_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="another checkout to alternate with this one")
    p.add_argument("--runs", type=int, default=4)
    a = p.parse_args()
    measured: dict[str, list[float]] = {"this checkout": []}
    other = "before" if a.before else "import torch alone"
    measured[other] = []
    for _ in range(a.runs):
        measured["this checkout"].append(coordinator_start_s(ROOT))
        measured[other].append(coordinator_start_s(a.before.resolve()) if a.before else torch_import_s())
    for name, values in measured.items():
        print(f"{name:18s} median {statistics.median(values):.2f} s ({', '.join(f'{v:.2f}' for v in values)})")
    print(f"ratio {other} / this checkout: "
          f"{statistics.median(measured[other]) / statistics.median(measured['this checkout']):.1f}x")


if __name__ == "__main__":
    main()
