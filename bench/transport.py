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

Loopback cases: the bound is the same bytes_sent per member over the rate of a raw duplex exchange
between two processes (each sends and receives at once, as a G=2 ring member does;
sendall/recv_into), measured in the same run beside a one-way raw copy.

This file runs the cases and reports them; the shaped members are in bench/transport_shaped.py,
the loopback members and raw baselines in bench/transport_loopback.py.

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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # its helpers, also when loaded by path (after the package `transport`)

import transport_loopback  # noqa: E402
from transport_shaped import Members, auto_chunk_bytes, shaped_case, shaped_n  # noqa: E402


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
