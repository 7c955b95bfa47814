"""Context switches per all-reduce of each thread of a ring member, gRPC or TCP link, on loopback
(a diagnostic beside ``bench/grpc_vs_tcp.py``: which threads hand each message on).

    python bench/grpc_thread_switches.py grpc        # or tcp; G=2, 64 MiB fp32, 5 all-reduces

Prints, per member, every thread with more than 4 switches per all-reduce: switches, thread id,
the OS name (grpcio's C core names its own threads) and the Python thread name where there is one.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchutil import spawn_members  # noqa: E402

REPS = 5


def _counts() -> dict[int, tuple[str, int]]:
    """Thread id -> (OS name, context switches so far) for this process's threads."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text().splitlines()
            comm = (task / "comm").read_text().strip()
        except OSError:  # a thread that ended while being read
            continue
        out[int(task.name)] = (comm, sum(int(line.split()[-1]) for line in status if "ctxt_switches" in line))
    return out


def _member(conn, cfg: dict) -> None:
    sys.path.insert(0, cfg["tree"])
    sys.path.insert(1, str(HERE))
    from benchutil import pin_malloc

    pin_malloc()
    import torch

    torch.set_num_threads(1)
    import compress
    from transport import TcpTransport
    from transport.grpclink import GrpcTransport

    cls = GrpcTransport if cfg["backend"] == "grpc" else TcpTransport
    t = cls("127.0.0.1", 0, secret=b"bench-secret", timeout_s=60)
    conn.send(t.address)
    ring = conn.recv()
    x = torch.randn(16 << 20)
    out = torch.empty_like(x)
    codec = compress.get_codec("fp32")
    t.all_reduce(x, ring, cfg["index"], tag="warm-up", codec=codec, out=out).wait()  # also connects
    conn.send("ready")
    conn.recv()
    before = _counts()
    for rep in range(REPS):
        t.all_reduce(x, ring, cfg["index"], tag=f"rep{rep}", codec=codec, out=out).wait()
    after = _counts()
    names = {th.native_id: th.name for th in threading.enumerate()}
    rows = [((n - before.get(tid, (comm, 0))[1]) // REPS, tid, comm, names.get(tid, ""))
            for tid, (comm, n) in after.items()]
    conn.send(sorted((r for r in rows if r[0] > 4), reverse=True))
    conn.recv()
    t.close()


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "grpc"
    tree = str(HERE.parent)
    pipes, procs = spawn_members(_member, [dict(tree=tree, backend=backend, index=i) for i in range(2)])
    addresses = [p.recv() for p in pipes]
    for p in pipes:
        p.send(addresses)
    for p in pipes:
        p.recv()
    for p in pipes:
        p.send("go")
    results = [p.recv() for p in pipes]
    for p in pipes:
        p.send("close")
    for proc in procs:
        proc.join(30)
    for i, rows in enumerate(results):
        print(f"member {i} ({backend}): context switches per all-reduce, by thread (total {sum(r[0] for r in rows)})")
        for switches, tid, comm, name in rows:
            print(f"  {switches:6d}  {tid}  {comm:14s} {name}")


if __name__ == "__main__":
    main()
