"""The shaped-link half of `bench/transport.py` (its cases are run from there): ring members in
the network namespaces of an `EmulatedWan` (transport/netns.py), one process per emulated host,
against the bound of the slowest host's link.

    bound_seconds = bytes_sent per member / slowest host's rate (payload bytes/s)

A member is this file run as `python bench/transport_shaped.py --member CFG` inside its namespace;
it serves cases one after another over JSON lines on stdin/stdout (see `_member_main`).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package `transport` before bench/transport.py
sys.path.append(str(Path(__file__).resolve().parent))

from benchutil import GlooBaseline, bench_codec, pin_malloc  # noqa: E402
from transport_loopback import SECRET  # noqa: E402

# -- shaped links: members in network namespaces ---------------------------------------------------

def _member_main(cfg: dict) -> None:
    """A ring member inside its namespace, serving cases one after another.

    JSON lines on stdin: {"cmd": "case", ...} builds a transport (answer: its address), "ring"
    warms the links up (answer: ready), "go" runs one timed all-reduce (answer: seconds, bytes
    sent), "end" closes the transport, "quit" exits.
    """
    if cfg.get("pin_malloc"):
        pin_malloc()
    import torch

    torch.set_num_threads(1)
    from transport import TcpTransport
    from transport.grpclink import GrpcTransport

    def say(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    t = case = codec = x = out = ring = None
    rep = 0
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "case" and msg["backend"] == "gloo":
            case = msg
            t = GlooBaseline(cfg["host"], cfg["index"], case["groups"])
            x = torch.randn(case["n"], generator=torch.Generator().manual_seed(cfg["index"]))
            say({"address": t.address})
        elif cmd == "case":
            case = msg
            cls = GrpcTransport if case["backend"] == "grpc" else TcpTransport
            t = cls(cfg["host"], 0, secret=SECRET, timeout_s=120, chunk_bytes=case["chunk_bytes"],
                    connections_per_peer=case["conns"], allow_plaintext=True)  # inside namespaces we made
            codec = bench_codec(case["codec"])
            if x is None or x.numel() != case["n"]:
                x = out = None
                x = torch.randn(case["n"], generator=torch.Generator().manual_seed(cfg["index"]))
                # the result buffer, reused across repetitions as the trainer reuses its own
                # (diloco/exchange/striped.py): a new 0.5 GB result per call would be mostly page faults
                out = torch.zeros_like(x)
            say({"address": t.address})
        elif cmd == "ring" and case["backend"] == "gloo":
            t.connect(msg["ring"])
            t.all_reduce_mean(torch.randn(len(msg["ring"]) * case["chunk_bytes"] // 4))  # opens its connections
            say({"ready": True})
        elif cmd == "go" and case["backend"] == "gloo":
            c0 = time.process_time()
            t0 = time.perf_counter()
            t.all_reduce_mean(x)
            say({"seconds": time.perf_counter() - t0, "sent": GlooBaseline.bytes_sent(case["n"], case["groups"]),
                 "cpu_s": time.process_time() - c0})
        elif cmd == "ring":
            ring = msg["ring"]
            # warm-up: opens every connection of the link (and warms the codec) with a small vector
            warm = torch.randn(len(ring) * case["chunk_bytes"] // 4)
            t.all_reduce(warm, ring, cfg["index"], tag="warm", codec=codec).wait()
            say({"ready": True})
        elif cmd == "go":
            before = t.bytes_sent
            c0 = time.process_time()
            t0 = time.perf_counter()
            t.all_reduce(x, ring, cfg["index"], tag=f"rep{rep}", codec=codec, out=out).wait()
            dt = time.perf_counter() - t0
            rep += 1
            say({"seconds": dt, "sent": t.bytes_sent - before, "cpu_s": time.process_time() - c0})
        elif cmd == "end":
            t.close()
            t = None
            say({"closed": True})
        elif cmd == "quit":
            break


class Members:
    """One member process per host of an EmulatedWan, reused across cases."""

    def __init__(self, wan, pin: bool) -> None:
        self.wan = wan
        self.procs = []
        try:
            for i in range(len(wan.rates_mbit)):
                cfg = dict(index=i, host=wan.ip(i), pin_malloc=pin)
                cmd = wan.exec_prefix(i) + [sys.executable, str(Path(__file__).resolve()), "--member", json.dumps(cfg)]
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                                   env=_member_env()))
        except BaseException:
            self.close()
            raise

    def send(self, i: int, obj: dict) -> None:
        self.procs[i].stdin.write(json.dumps(obj) + "\n")
        self.procs[i].stdin.flush()

    def recv(self, i: int) -> dict:
        line = self.procs[i].stdout.readline()
        if not line:
            raise RuntimeError(f"member {i} exited (rc={self.procs[i].wait()})")
        return json.loads(line)

    def all(self, obj: dict | list[dict]) -> list[dict]:
        objs = obj if isinstance(obj, list) else [obj] * len(self.procs)
        for i, o in enumerate(objs):
            self.send(i, o)
        return [self.recv(i) for i in range(len(self.procs))]

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            try:
                if p.poll() is None:
                    self.send(i, {"cmd": "quit"})
                p.wait(20)
            except (OSError, ValueError, subprocess.TimeoutExpired):  # member already gone or stuck: killed below
                pass
            if p.poll() is None:
                p.kill()
                p.wait()


_SENT_RE = re.compile(r"Sent (\d+) bytes (\d+) pkt")


def _qdisc_sent(ns: str | None, dev: str) -> tuple[int, int]:
    """(bytes, packets) the root qdisc of dev has sent (headers included)."""
    cmd = ["tc", "-s"] + (["-n", ns] if ns else []) + ["qdisc", "show", "dev", dev]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    m = _SENT_RE.search(out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _wan_counters(wan) -> list[tuple[int, int, int, int]]:
    """Per host: (egress bytes, egress packets, ingress bytes, ingress packets) at the tbf qdiscs."""
    out = []
    for i in range(len(wan.rates_mbit)):
        eb, ep = _qdisc_sent(wan.namespace(i), "eth0")
        ib, ip_ = _qdisc_sent(None, f"dlc{wan.tag}v{i}")
        out.append((eb, ep, ib, ip_))
    return out


def _member_env() -> dict:
    env = dict(os.environ)
    for k in list(env):
        if k.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy"):
            del env[k]
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def shaped_case(members: Members, backend: str, codec: str, conns: int, n: int, reps: int, chunk_bytes: int) -> dict:
    """One all-reduce case on the emulated WAN; best of reps (slowest member per rep)."""
    wan = members.wan
    g = len(wan.rates_mbit)
    res = members.all({"cmd": "case", "backend": backend, "codec": codec, "conns": conns, "n": n,
                       "chunk_bytes": chunk_bytes, "groups": g})
    ring = [r["address"] for r in res]
    members.all({"cmd": "ring", "ring": ring})
    runs = []
    for _ in range(reps):
        c0 = _wan_counters(wan)
        res = members.all({"cmd": "go"})
        c1 = _wan_counters(wan)
        deltas = [tuple(b - a for a, b in zip(x0, x1)) for x0, x1 in zip(c0, c1)]
        runs.append((max(r["seconds"] for r in res), max(r["sent"] for r in res), deltas, [r["cpu_s"] for r in res]))
    members.all({"cmd": "end"})
    seconds, sent, deltas, cpu = min(runs, key=lambda r: r[0])
    rates = [r for r in wan.rates_mbit]
    slow = min(rates)
    rate_Bps = slow * 1e6 / 8
    bound = sent / rate_Bps  # = 2(G-1)/G x wire_bytes / rate
    # what the tbf qdiscs really carried (IP/TCP/Ethernet headers, ACKs, both directions of each host)
    line_bound = max(max(d[0], d[2]) / (r * 1e6 / 8) for d, r in zip(deltas, rates))
    line_bytes = max(max(d[0], d[2]) for d in deltas)
    label = "/".join(f"{r:g}" for r in rates) if len(set(rates)) > 1 else f"{slow:g}"
    return {
        "case": (f"shaped {label} Mbit/s gloo {codec} (torch.distributed)" if backend == "gloo" else
                 f"shaped {label} Mbit/s {backend} conns={conns} {codec} chunk={chunk_bytes >> 10}KiB"),
        "bytes_counted": backend != "gloo",
        "kind": "shaped",
        "backend": backend,
        "codec": codec,
        "connections": conns,
        "groups": g,
        "link_mbit": slow,
        "rates_mbit": rates,
        "seconds": seconds,
        "median_seconds": statistics.median(r[0] for r in runs),
        "all_seconds": [r[0] for r in runs],
        "bound_seconds": bound,
        "ratio_to_bound": seconds / bound,
        "elements": n,
        "chunk_bytes": chunk_bytes,
        "tls": False,
        "congestion": wan.congestion or "kernel default",
        "tbf_latency_ms": wan.latency_ms,
        "tbf_burst_ms": wan.burst_ms,
        "bytes_sent_per_member": sent,
        "wire_bytes": sent * g / (2 * (g - 1)),
        "goodput_mbit": sent * 8 / seconds / 1e6,
        "line_bytes_max": line_bytes,
        "line_bound_seconds": line_bound,
        "ratio_to_line_bound": seconds / line_bound,
        "header_overhead": line_bytes / sent - 1,
        "busbw_gbps": sent / seconds / 1e9,
        "algbw_gbps": n * 4 / seconds / 1e9,
        "member_cpu_s": cpu,  # user+system CPU time of each member process during the best repetition
    }


def bytes_per_element(codec: str, chunk_bytes: int) -> float:
    """Bytes on the wire per fp32 element for codec (frame + message header), measured on one chunk."""
    import torch

    k = chunk_bytes // 4
    return (len(bench_codec(codec).encode(torch.randn(k))) + 64) / k


def auto_chunk_bytes(rates: list, codec: str, chunk_ms: float) -> int:
    """chunk_bytes (fp32 input per chunk) whose frame takes about chunk_ms on the slowest link, as a
    power of two in [128 KiB, 4 MiB]: short enough that filling and draining the pipeline costs
    little, long enough that per-chunk costs stay small at high rates."""
    import math

    rate = min(rates) * 1e6 / 8
    want = rate * chunk_ms / 1000 * 4 / bytes_per_element(codec, 1 << 20)
    return int(min(max(2 ** round(math.log2(want)), 128 << 10), 4 << 20))


def shaped_n(rates: list, codec: str, chunk_bytes: int, target_s: float, max_elems: int) -> int:
    """Vector length whose bound is about target_s (capped), a multiple of G chunks."""
    g = len(rates)
    rate = min(rates) * 1e6 / 8
    n = int(target_s * rate / (2 * (g - 1) / g * bytes_per_element(codec, chunk_bytes)))
    step = g * (chunk_bytes // 4)
    return max(step, min(n, max_elems) // step * step)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--member":
        sys.exit("usage: transport_shaped.py --member CFG (started by bench/transport.py; run that instead)")
    _member_main(json.loads(sys.argv[2]))
