"""gRPC link against TCP link on loopback: one ring all-reduce of an fp32 vector between G members
(each a spawned process on 127.0.0.1), as a ratio to the TCP link measured in the same run.

Cases run round-robin (rounds x cases), so a shared machine's load falls on all of them alike;
every member reports each repetition's wall time (the slowest member's counts) and its CPU time.
``--trees`` runs the gRPC link of several code trees (a before/after pair from ``git archive``)
against the TCP link of the first tree:

    python bench/grpc_vs_tcp.py                                         # this tree, 64 MiB, G=2
    git archive OLD | tar -x -C /tmp/before
    python bench/grpc_vs_tcp.py --trees /tmp/before,. --rounds 4 --reps 5

``--copies`` adds a case that only copies, chunk by chunk, the bytes a member sends and receives
as often as grpcio's ``bytes``-only API makes a gRPC link copy them (4 user-space passes): TCP's
time plus that is a floor under any link built on grpcio. Every case also reports the context
switches of its busiest member per all-reduce (all threads, from /proc); ``--json FILE`` appends
the run (every repetition of every case) to a JSON list.

``--profile DIR`` records member 0 of every case with ``perf record -g`` (all threads, native
frames) over the timed repetitions; ``perf report -i DIR/grpc-1-r0.perf -n --no-children --sort
dso --stdio -g none`` then splits its CPU by library (needs perf).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SECRET = b"bench-secret"
COPY_PASSES = 4  # the copies case: user-space copies of every byte gRPC needs beyond TCP's work (see _copies)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchutil import append_record, spawn_members  # noqa: E402


def _switches() -> int:
    """Context switches (voluntary and not) of this process's threads so far, from /proc."""
    total = 0
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.endswith("ctxt_switches:") or "ctxt_switches:" in line:
                    total += int(line.split()[-1])
        except OSError:  # a thread that ended while being read
            pass
    return total


def _copies(x, groups: int, chunk_bytes: int) -> None:
    """What a gRPC member cannot avoid beyond a TCP member's work: COPY_PASSES user-space copies,
    chunk by chunk into a fresh buffer each, of the bytes a ring member sends and receives
    (2 (G-1)/G of the vector each way). grpcio takes and gives messages only as ``bytes``:
    sending, a copy into one and grpcio's copy into its core slice; receiving, grpcio's copy of
    the slices into ``bytes`` and their join (one slice: no join)."""
    view = memoryview(x.numpy()).cast("B")
    each_way = len(view) * 2 * (groups - 1) // groups
    for _ in range(COPY_PASSES // 2):  # both directions' bytes, COPY_PASSES // 2 copies each
        for k in range(0, 2 * each_way, chunk_bytes):
            i = k % len(view)
            bytes(view[i:i + chunk_bytes])


def _member(conn, cfg: dict) -> None:
    sys.path.insert(0, cfg["tree"])
    sys.path.insert(1, str(HERE))
    from benchutil import bench_codec, pin_malloc

    pin_malloc()
    import torch

    torch.set_num_threads(1)
    from transport import TcpTransport
    from transport.grpclink import GrpcTransport

    t = None
    if cfg["backend"] != "copies":
        cls = GrpcTransport if cfg["backend"] == "grpc" else TcpTransport
        t = cls("127.0.0.1", 0, secret=SECRET, timeout_s=120, chunk_bytes=cfg["chunk_bytes"])
    conn.send((t.address if t else "", os.getpid()))
    ring = conn.recv()
    codec = bench_codec(cfg["codec"])
    x = torch.randn(cfg["n"], generator=torch.Generator().manual_seed(cfg["index"]))
    out = torch.empty_like(x)
    for rep in range(cfg["reps"] + 1):  # the first one also sets up the connections
        conn.recv()  # go
        sw0, cpu0, t0 = _switches(), time.process_time(), time.perf_counter()
        if t is None:
            _copies(x, cfg["groups"], cfg["chunk_bytes"])
        else:
            t.all_reduce(x, ring, cfg["index"], tag=f"rep{rep}", codec=codec, out=out).wait()
        conn.send((time.perf_counter() - t0, time.process_time() - cpu0, _switches() - sw0))
    conn.recv()  # close once every member is done
    if t is not None:
        t.close()


def ring_case(tree: str, backend: str, g: int, n: int, reps: int, chunk_bytes: int, codec: str,
              profile: Path | None) -> tuple[list[float], list[float], list[int]]:
    """Per-rep seconds (slowest member), CPU seconds (busiest member) and context switches (the
    member with most) of one case."""
    pipes, procs = spawn_members(_member, [dict(tree=tree, backend=backend, n=n, reps=reps, chunk_bytes=chunk_bytes,
                                                codec=codec, index=i, groups=g) for i in range(g)])
    hello = [c.recv() for c in pipes]
    for c in pipes:
        c.send([h[0] for h in hello])
    spy = None
    secs, cpus, switches = [], [], []
    for rep in range(reps + 1):
        if rep == 1 and profile is not None:
            spy = subprocess.Popen(["perf", "record", "-F", "1999", "-g", "-p", str(hello[0][1]), "-o", str(profile)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        for c in pipes:
            c.send("go")
        res = [c.recv() for c in pipes]
        if rep:
            secs.append(max(r[0] for r in res))
            cpus.append(max(r[1] for r in res))
            switches.append(max(r[2] for r in res))
    if spy is not None:
        spy.send_signal(2)
        spy.wait(30)
    for c in pipes:
        c.send("close")
    for p in procs:
        p.join(30)
    return secs, cpus, switches


def _per_round(values: list[float], base: list[float], rounds: int) -> list[float]:
    """Each round's median of ``values`` over that round's median of ``base``."""
    k, kb = len(values) // rounds, len(base) // rounds
    return [statistics.median(values[i * k:(i + 1) * k]) / statistics.median(base[i * kb:(i + 1) * kb])
            for i in range(rounds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=".", help="comma-separated code trees; gRPC runs from each, TCP from the first")
    ap.add_argument("--mib", type=int, default=64, help="vector size in MiB of fp32")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="timed all-reduces per case and round (after one warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the cases")
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--no-tcp", action="store_true", help="gRPC cases only")
    ap.add_argument("--copies", action="store_true",
                    help=f"add a case timing only the {COPY_PASSES} user-space copies per byte that grpcio's API "
                         "imposes (no network): TCP + that is a floor under any gRPC link of this kind")
    ap.add_argument("--profile", type=Path, help="folder for perf recordings of each case's member 0")
    ap.add_argument("--json", type=Path, help="append this run's record (every rep of every case) to this JSON list")
    a = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in a.trees.split(",")]
    cases = ([] if a.no_tcp else [("tcp", trees[0])]) + [("grpc", t) for t in trees]
    if a.copies:
        cases.append(("copies", trees[0]))
    n = (a.mib << 20) // 4
    if a.profile is not None:
        if shutil.which("perf") is None:
            sys.exit("--profile needs perf")
        a.profile.mkdir(parents=True, exist_ok=True)
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    cpu: dict[tuple, list[float]] = {c: [] for c in cases}
    sw: dict[tuple, list[int]] = {c: [] for c in cases}
    t_start = time.perf_counter()
    for rnd in range(a.rounds):
        for k, (backend, tree) in enumerate(cases):
            prof = a.profile / f"{backend}-{k}-r{rnd}.perf" if a.profile is not None else None
            s, c, w = ring_case(tree, backend, a.groups, n, a.reps, a.chunk_bytes, a.codec, prof)
            times[(backend, tree)] += s
            cpu[(backend, tree)] += c
            sw[(backend, tree)] += w
            print(f"round {rnd} {backend:6s} {tree}: median {statistics.median(s) * 1e3:6.1f} ms "
                  f"(min {min(s) * 1e3:.1f}, max {max(s) * 1e3:.1f}), CPU {statistics.median(c) * 1e3:.0f} ms, "
                  f"{statistics.median(w):.0f} context switches", flush=True)
    print(f"\n{a.mib} MiB fp32 vector, G={a.groups}, chunk {a.chunk_bytes >> 10} KiB, codec {a.codec}, "
          f"{a.rounds} rounds x {a.reps} reps, {time.perf_counter() - t_start:.0f} s, load {os.getloadavg()[0]:.2f}")
    tcp = None if a.no_tcp else cases[0]
    base = statistics.median(times[tcp]) if tcp else None
    record: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "load_1min": os.getloadavg()[0], "cases": []}
    for c in cases:
        s = sorted(times[c])
        med = statistics.median(s)
        q1, q3 = s[len(s) // 4], s[(3 * len(s)) // 4]
        ratio = f"  {med / base:.2f}x tcp" if base else ""
        print(f"{c[0]:6s} {c[1]}: median {med * 1e3:6.1f} ms, IQR {q1 * 1e3:.1f}-{q3 * 1e3:.1f}, "
              f"min {s[0] * 1e3:.1f}, max {s[-1] * 1e3:.1f}; member CPU median {statistics.median(cpu[c]) * 1e3:.0f} ms, "
              f"context switches median {statistics.median(sw[c]):.0f}{ratio}")
        entry = {"backend": c[0], "tree": c[1], "seconds": times[c], "cpu_seconds": cpu[c], "context_switches": sw[c],
                 "median_s": med, "cpu_median_s": statistics.median(cpu[c])}
        if tcp and c != tcp:
            rs = _per_round(times[c], times[tcp], a.rounds)
            if c[0] == "copies":  # tcp + the copies: the floor under a gRPC link's time, as a ratio to tcp
                rs = [1.0 + r for r in rs]
                print(f"  tcp + {COPY_PASSES} copies per byte (a floor for gRPC): {1.0 + med / base:.2f}x tcp; per round: "
                      + ", ".join(f"{r:.2f}" for r in rs))
            else:
                print(f"  {c[0]} {c[1]} / tcp per round: " + ", ".join(f"{r:.2f}" for r in rs))
            entry.update(ratio_to_tcp=(1.0 + med / base) if c[0] == "copies" else med / base, ratio_per_round=rs)
        record["cases"].append(entry)
    if a.json is not None:
        append_record(a.json, record)


if __name__ == "__main__":
    main()
