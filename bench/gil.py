"""How much a ring all-reduce running beside a training loop slows that loop through Python's
interpreter lock (issue 10, point 3), measured apart from plain CPU contention.

A *trainer* thread in this process launches small torch ops back to back (what a training loop
does between kernels: each launch needs the interpreter lock) and counts them. Three cases run
for the same time:

* ``alone``: the trainer only;
* ``threads``: this process is also a ring member (its transport's threads in this process), the
  other member is a child process, and they all-reduce back to back;
* ``process``: the same all-reduces, but this process's member runs in a child process too;
* ``dataplane``: this process is the ring member again, through `transport.ProcessTransport`
  (``--data-plane process`` of ``diloco run``): its thread only starts collectives and waits,
  copying the vectors in and out of shared memory; the transport runs in its child process.

``threads`` and ``process`` do the same work on the same cores; they differ only in whether the
collective's Python code shares the trainer's interpreter lock. So

    lock cost = 1 - rate(threads) / rate(process)

is the share of the trainer's work lost to the lock, and 1 - rate(process) / rate(alone) the share
lost to the CPU the collective needs anyway. ``1 - rate(dataplane) / rate(process)`` is what the
data-plane process leaves of the lock cost (its copies and control messages).

    python bench/gil.py --json bench/results/gil.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SECRET = b"bench-gil-secret"


def _member(index: int, addr_q, peer_q, stop, done_q, n: int, codec: str, chunk_bytes: int,
            data_plane: str = "thread") -> None:
    """A ring member: all-reduce back to back until stop is set; rounds and seconds to done_q.
    data_plane "process": through a `ProcessTransport` (the transport in a child process)."""
    torch.set_num_threads(1)
    import compress
    from transport import ProcessTransport, TcpTransport

    link = ProcessTransport if data_plane == "process" else TcpTransport
    t = link(host="127.0.0.1", port=0, secret=SECRET, timeout_s=30, chunk_bytes=chunk_bytes)
    try:
        addr_q.put((index, t.address))
        ring = peer_q.get(timeout=60)
        x, out = torch.full((n,), float(index + 1)), torch.empty(n)
        c = compress.get_codec(codec)
        rounds, start = 0, time.perf_counter()
        while not stop.is_set():
            try:
                t.all_reduce(x, ring, index, tag=f"r{rounds}", codec=c, out=out).wait()
            except Exception:
                if stop.is_set():  # the other member stopped first, mid-round: the end, not a failure
                    break
                raise
            rounds += 1
        done_q.put((index, rounds, time.perf_counter() - start))
    finally:
        t.close(flush_timeout_s=1.0)


def _trainer_rate(seconds: float) -> float:
    """Small torch ops launched per second by this thread for ``seconds``."""
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    ops, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            a = torch.addmm(a, a, b, alpha=1e-3, beta=0.5)
        ops += 100
    return ops / seconds


def run_case(case: str, seconds: float, n: int, codec: str, chunk_bytes: int) -> dict:
    torch.set_num_threads(1)
    if case == "alone":
        return {"case": case, "trainer_ops_per_s": _trainer_rate(seconds)}
    ctx = mp.get_context("spawn")
    addr_q, stop, done_q = ctx.Queue(), ctx.Event(), ctx.Queue()
    peer_qs = [ctx.Queue(), ctx.Queue()]
    local = case in ("threads", "dataplane")
    procs = [ctx.Process(target=_member, args=(i, addr_q, peer_qs[i], stop, done_q, n, codec, chunk_bytes))
             for i in range(1 if local else 0, 2)]  # with local, member 0 is a thread of this process
    for p in procs:
        p.start()
    th = None
    if local:
        th = threading.Thread(target=_member, args=(0, addr_q, peer_qs[0], stop, done_q, n, codec, chunk_bytes,
                                                    "process" if case == "dataplane" else "thread"))
        th.start()
    addrs = dict(addr_q.get(timeout=60) for _ in range(2))
    ring = [addrs[0], addrs[1]]
    for q in peer_qs:
        q.put(ring)
    time.sleep(1.0)  # connections up, first rounds done
    rate = _trainer_rate(seconds)
    stop.set()
    done = dict((i, (r, s)) for i, r, s in (done_q.get(timeout=60) for _ in range(2)))
    for p in procs:
        p.join(30)
    if th is not None:
        th.join(30)
    rounds, secs = done[0]
    return {"case": case, "trainer_ops_per_s": rate, "all_reduces_per_s": rounds / secs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="trainer time per case")
    p.add_argument("--elems", type=int, default=1 << 22, help="fp32 values per all-reduce")
    p.add_argument("--codecs", default="fp32,int8", help="comma-separated codecs")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--rounds", type=int, default=2, help="passes over the cases (interleaved), best kept")
    p.add_argument("--json", help="write the records here")
    a = p.parse_args(argv)
    records = []
    for codec in a.codecs.split(","):
        best: dict[str, dict] = {}
        for _ in range(a.rounds):
            for case in ("alone", "threads", "process", "dataplane"):
                r = run_case(case, a.seconds, a.elems, codec, a.chunk_bytes)
                if case not in best or r["trainer_ops_per_s"] > best[case]["trainer_ops_per_s"]:
                    best[case] = r
        alone, threads, proc, plane = (best[c]["trainer_ops_per_s"] for c in ("alone", "threads", "process", "dataplane"))
        rec = {"codec": codec, "elems": a.elems, "chunk_bytes": a.chunk_bytes, "cpus": os.cpu_count(),
               "trainer_alone_ops_per_s": round(alone), "trainer_threads_ops_per_s": round(threads),
               "trainer_process_ops_per_s": round(proc), "trainer_dataplane_ops_per_s": round(plane),
               "all_reduces_per_s_threads": round(best["threads"]["all_reduces_per_s"], 2),
               "all_reduces_per_s_process": round(best["process"]["all_reduces_per_s"], 2),
               "all_reduces_per_s_dataplane": round(best["dataplane"]["all_reduces_per_s"], 2),
               "lock_cost": round(1 - threads / proc, 3), "cpu_cost": round(1 - proc / alone, 3),
               "dataplane_lock_cost": round(1 - plane / proc, 3)}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    if a.json:
        Path(a.json).write_text(json.dumps({"command": "python bench/gil.py " + " ".join(argv or sys.argv[1:]),
                                            "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
