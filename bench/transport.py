"""Benchmark the transport's ring all-reduce: on emulated WAN links against the link bound, and
on loopback against a raw socket copy measured in the same run.

Shaped cases: an `EmulatedWan` (transport/netns.py: one network namespace per host, veth + bridge,
`tc tbf` on both ends of each host's link) and every ring member its own process in its own
namespace, listening on its namespace's address. Per case the bound is

    bound_seconds = 2(G-1)/G x wire_bytes / bottleneck rate = bytes_sent per member / rate

where wire_bytes is the size of the whole vector as encoded on the wire (codec frames plus the
transport's message headers: `bytes_sent` per member x G / 2(G-1)), and the rate is the slowest
host's rate in payload bytes/s (rate_mbit x 1e6 / 8). TCP/IP/Ethernet headers and ACKs are NOT in
wire_bytes; the qdisc byte counters (which include them) are recorded too (`line_*` fields).

Loopback cases (bench/transport_loopback.py): the bound is the same bytes_sent per member over the
rate of a raw duplex exchange between two processes (each sends and receives at once, as a G=2 ring
member does; sendall/recv_into), measured in the same run beside a one-way raw copy.

    python bench/transport.py --quick                                     # < 1 minute
    python bench/transport.py --json bench/results/transport.json --plot bench/results/transport.png

Needs root and iproute2 for the shaped cases (skipped with a message otherwise).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # its helpers, also when loaded by path (after the package `transport`)

import transport_loopback  # noqa: E402
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
                # (diloco/group.py): a new 0.5 GB result per call would be mostly page faults
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


# -- report --------------------------------------------------------------------------------------

def markdown_table(records: list[dict]) -> str:
    """The README tables: shaped cases against the bound, loopback cases against the raw copy."""
    lines = []
    shaped = [r for r in records if r["kind"] == "shaped"]
    if shaped:
        lines += ["| links (Mbit/s) | backend | conns | codec | chunk | seconds | bound s | ratio | vs qdisc bytes | goodput Mbit/s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in shaped:
            links = "/".join(f"{x:g}" for x in r["rates_mbit"])
            lines.append(f"| {links} | {r['backend']} | {r['connections']} | {r['codec']} | {r['chunk_bytes'] >> 10} KiB "
                         f"| {r['seconds']:.3f} | {r['bound_seconds']:.3f} | **{r['ratio_to_bound']:.3f}** "
                         f"| {r['ratio_to_line_bound']:.3f} | {r['goodput_mbit']:.1f} |")
    loop = [r for r in records if r["kind"] == "loopback"]
    if loop:
        lines += [""] + transport_loopback.table(loop)
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shaped = [r for r in records if r["kind"] == "shaped"]
    loop = [r for r in records if r["kind"] == "loopback"]
    fig, axes = plt.subplots(1, 2, figsize=(15, max(4, 0.28 * max(len(shaped), 8) + 1.5)),
                             gridspec_kw={"width_ratios": [2, 1]})
    ax = axes[0]
    if shaped:
        names = [r["case"].replace("shaped ", "") for r in shaped]
        ys = range(len(shaped))
        colors = [{"tcp": "tab:blue", "grpc": "tab:orange"}.get(r["backend"], "tab:gray") for r in shaped]
        ax.barh(ys, [r["ratio_to_bound"] for r in shaped], color=colors)
        ax.scatter([r["ratio_to_line_bound"] for r in shaped], ys, color="k", marker="|", s=80,
                   label="vs bound on qdisc bytes (headers + ACKs)", zorder=3)
        ax.axvline(1.0, color="gray", lw=1)
        ax.axvline(1.10, color="red", ls="--", lw=1, label="target 1.10")
        ax.set_yticks(list(ys), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("all-reduce time / bound  (bound = 2(G-1)/G x wire bytes / bottleneck rate)")
        ax.set_xlim(0.9, max(1.3, max(r["ratio_to_bound"] for r in shaped) + 0.05))
        ax.legend(fontsize=7, loc="lower right")
        ax.set_title("emulated WAN, G=3 (blue tcp, orange grpc, gray torch.distributed gloo)")
    ax = axes[1]
    if loop:
        names = [r["case"].replace("loopback ", "") for r in loop]
        vals = [r.get("gbps", r.get("busbw_gbps", 0)) for r in loop]
        ax.barh(range(len(loop)), vals, color=[{"raw": "tab:gray", "gloo": "tab:red"}.get(r["backend"], "tab:green")
                                               for r in loop])
        ax.set_yticks(range(len(loop)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s (raw: each way; ring: sent per member)")
        ax.set_title("loopback vs raw socket copy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--member", help=argparse.SUPPRESS)
    ap.add_argument("--table", type=Path, help="print the markdown tables of a JSON written before, and exit")
    ap.add_argument("--quick", action="store_true", help="one shaped case per backend + a small loopback case (< 1 min)")
    ap.add_argument("--json", type=Path, help="write the list of records here")
    ap.add_argument("--plot", type=Path, help="write a PNG plot here")
    ap.add_argument("--only", choices=["all", "shaped", "loopback"], default="all")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per case (best kept)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="passes over all cases, best kept (default: shaped 2, loopback 3; quick 1)")
    ap.add_argument("--target-s", type=float, default=None, help="shaped: vector sized for a bound of about this")
    ap.add_argument("--shaped-chunk", type=int, default=0,
                    help="shaped: chunk_bytes (fp32 input per chunk); 0 = about --chunk-ms on the slowest link")
    ap.add_argument("--chunk-ms", type=float, default=20.0, help="shaped: wire time of one chunk when chosen automatically")
    ap.add_argument("--max-elems", type=int, default=128 << 20, help="shaped: cap on the vector length")
    ap.add_argument("--rates", default=None,
                    help="shaped: semicolon-separated host rate lists, e.g. '100,100,100;1000,1000,1000'")
    ap.add_argument("--tbf-latency-ms", type=float, default=200.0, help="shaped: tbf queue length in ms")
    ap.add_argument("--tbf-burst-ms", type=float, default=4.0, help="shaped: tbf bucket in ms")
    ap.add_argument("--congestion", default="reno",
                    help="shaped: TCP congestion control inside the emulated hosts ('' = the kernel's default)")
    ap.add_argument("--backends", default="tcp,grpc")
    ap.add_argument("--codecs", default=None, help="shaped: codecs (default fp32,int8,int4,int4/fast; "
                    "NAME/fast: a 4-bit codec without its scale search)")
    ap.add_argument("--conns", default=None, help="shaped: connections per peer (default 1,4)")
    ap.add_argument("--pin-malloc", action="store_true",
                    help="members keep freed buffers in the heap (glibc mallopt), as a tuned deployment would")
    a = ap.parse_args()
    if a.member:
        _member_main(json.loads(a.member))
        return
    if a.table:
        print(markdown_table(json.loads(a.table.read_text())))
        return
    t_start = time.perf_counter()
    records: list[dict] = []
    backends = a.backends.split(",")
    if a.only in ("all", "shaped"):
        from transport.netns import EmulatedWan, available

        ok, why = available()
        if not ok:
            print(f"skipping shaped cases: {why}", flush=True)
        else:
            if a.rates:
                rate_sets = [[float(x) for x in s.split(",")] for s in a.rates.split(";")]
            elif a.quick:
                rate_sets = [[100.0] * 3]
            else:
                rate_sets = [[100.0] * 3, [1000.0] * 3, [100.0, 100.0, 25.0]]
            codecs = (a.codecs or ("fp32" if a.quick else "fp32,int8,int4,int4/fast")).split(",")
            conns_list = [int(c) for c in (a.conns or ("1" if a.quick else "1,4")).split(",")]
            reps = a.reps or (1 if a.quick else 2)
            shaped_rounds = a.rounds or (1 if a.quick else 2)
            target = a.target_s or (1.5 if a.quick else 3.0)
            for rates in rate_sets:
                with EmulatedWan(rates, burst_ms=a.tbf_burst_ms, latency_ms=a.tbf_latency_ms,
                                 congestion=a.congestion or None) as wan:
                    members = Members(wan, a.pin_malloc)
                    try:
                        best_shaped: dict[tuple, dict] = {}
                        for rnd in range(shaped_rounds):  # rounds: a shared machine's load comes and goes
                            for codec in codecs:
                                chunk = a.shaped_chunk or auto_chunk_bytes(rates, codec, a.chunk_ms)
                                n = shaped_n(rates, codec, chunk, target, a.max_elems)
                                for conns in conns_list:
                                    # the Gloo baseline: fp32 only, once per link (it has its own connections)
                                    baseline = ["gloo"] if codec == "fp32" and conns == conns_list[0] else []
                                    for backend in backends + baseline:
                                        r = shaped_case(members, backend, codec, conns, n, reps, chunk)
                                        r["pinned_malloc"] = a.pin_malloc
                                        key = (codec, conns, backend)
                                        old = best_shaped.get(key)
                                        if old is not None:
                                            r["all_seconds"] = old["all_seconds"] + r["all_seconds"]
                                            if old["seconds"] <= r["seconds"]:
                                                old["all_seconds"] = r["all_seconds"]
                                                r = old
                                        r["median_seconds"] = statistics.median(r["all_seconds"])
                                        best_shaped[key] = r
                                        if rnd < shaped_rounds - 1:
                                            continue
                                        records.append(r)
                                        print(f"{r['case']:45s} {r['seconds']:7.3f} s  bound {r['bound_seconds']:7.3f} s  "
                                              f"ratio {r['ratio_to_bound']:5.3f}  (vs qdisc bytes {r['ratio_to_line_bound']:5.3f}, "
                                              f"headers+ACKs +{r['header_overhead'] * 100:.1f} %) cpu {sum(r['member_cpu_s']):.2f} s", flush=True)
                    finally:
                        members.close()
    if a.only in ("all", "loopback"):
        for r in transport_loopback.run(a.quick, a.reps, a.rounds, backends, a.pin_malloc):
            records.append(r)
            extra = "" if r["backend"] == "raw" else f"  {r['busbw_over_duplex'] * 100:4.0f} % of the raw duplex exchange"
            print(f"{r['case']:55s} {r['seconds'] * 1e3:7.1f} ms  {r.get('busbw_gbps', r.get('gbps')):.3f} GB/s{extra}",
                  flush=True)
    meta = {"argv": sys.argv[1:], "python": platform.python_version(), "machine": platform.machine(),
            "cpus": mp.cpu_count(), "load_avg": os.getloadavg(), "quick": a.quick,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": time.perf_counter() - t_start}
    for r in records:
        r["meta"] = meta
    print()
    print(markdown_table(records))
    print(f"wall time {meta['wall_s']:.1f} s", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(records, indent=2) + "\n")
        print(f"wrote {a.json}")
    if a.plot:
        plot(records, a.plot)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
