"""The stall a blocking sync costs per outer round: the project (``diloco.connect`` + ``diloco.DiLoCo``,
blocking, the way the README's API section runs it) beside a plain Gloo DiLoCo written the way a
PyTorch user writes it (``torch.distributed`` all_reduce of Δ, then Nesterov SGD; no project code in
its path), on the same GPT, the same links, in the same run.

One process per group, each in its own network namespace (``transport.netns.EmulatedWan``: ``--links
1gbit`` shaped by tbf, ``veth`` unshaped) or all on 127.0.0.1 (``loopback``). A round is H inner
steps on random tokens, then the sync; its *stall* is the wall time from the end of the H-th inner
step until training may go on (the project: ``engine.step()`` on a sync step; Gloo: Δ, all_reduce,
outer step, copy back). The first ``--warmup`` rounds are not counted.

For the project each stall is broken down by timing the functions it passes through (bench-only
wrappers, ``_Spans``): Δ, state hash, contribution norm, the coordinator's quorum answer, the rings
(launch to last stripe, finite checks of the mean included), the vote, the landing (in-group share,
copies), the outer step, the merge back into the model; and the CPU seconds the whole process used
during the stall (all threads: the data plane's included) against its wall time.

    python bench/sync_stall.py --groups 2,3 --links loopback,veth,1gbit --codecs fp32,int8,fp32@grpc \\
        --rounds 4 --h 10 --json bench/results/sync_stall_before.json
    python bench/sync_stall.py --report bench/results/sync_stall_before.json

Writes a JSON record (every round of every member) and prints a line per case; ``--report``
prints the tables of bench/pages/sync_stall.md. bench/results/sync_stall_ab.json holds the
before/after runs of that page (the same harness on two trees, interleaved).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sync_stall_report import LINKS, MODEL, ab_report, report, summarize  # noqa: E402
from transport.link_spec import DEFAULT_CHUNK_BYTES  # noqa: E402


# -- members ------------------------------------------------------------------------------------------

def _page_faults() -> int:
    """Minor page faults of this process so far (all threads): a fresh large buffer costs one per 4 KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _Spans:
    """Wall seconds spent in named functions, per round (bench-only timing wrappers)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.lock = threading.Lock()

    def wrap(self, owner, name: str, key: str) -> None:
        fn = getattr(owner, name)
        spans = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with spans.lock:
                    spans.now[key] = spans.now.get(key, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        with self.lock:
            out, self.now = self.now, {}
        return out


def _model_and_data(cfg: dict):
    import torch

    from diloco.demo.model import GPT, GPTConfig

    torch.manual_seed(0)  # every group starts from the same parameters
    model = GPT(GPTConfig(**MODEL))
    gen = torch.Generator().manual_seed(1000 + cfg["group"])

    def batch():
        x = torch.randint(0, MODEL["vocab_size"], (cfg["batch"], cfg["seq"] + 1), generator=gen)
        return x[:, :-1], x[:, 1:]

    return model, batch


def _inner_step(model, opt, batch) -> None:
    x, y = batch()
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _member_gloo(cfg: dict) -> list[dict]:
    """Plain DiLoCo over torch.distributed Gloo: what a PyTorch user writes."""
    import torch
    import torch.distributed as dist
    from torch.nn.utils import parameters_to_vector

    dist.init_process_group("gloo", init_method=f"tcp://{cfg['gloo_master']}", rank=cfg["group"],
                            world_size=cfg["groups"])
    model, batch = _model_and_data(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    global_params = parameters_to_vector(model.parameters()).detach().clone()
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    outer = torch.optim.SGD([global_params], lr=0.7, momentum=0.9, nesterov=True)
    rounds = []
    for r in range(cfg["warmup"] + cfg["rounds"]):
        for _ in range(cfg["h"]):
            _inner_step(model, opt, batch)
        w0, t0, c0, f0 = time.time(), time.perf_counter(), time.process_time(), _page_faults()
        with torch.no_grad():
            delta = global_params - parameters_to_vector(model.parameters())
            dist.all_reduce(delta)
            delta /= cfg["groups"]
            global_params.grad = delta
            outer.step()
            # copied back (torch's vector_to_parameters would make the parameters views of the global
            # copy: the inner steps would then train it in place and every later Δ would be 0)
            for p, g in zip(params, torch.split(global_params, sizes)):
                p.copy_(g.view_as(p))
        stall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rounds.append({"round": r, "stall_s": stall, "cpu_s": cpu, "start": w0, "end": w0 + stall,
                       "page_faults": _page_faults() - f0, "delta_norm": float(delta.norm())})
    rounds[-1]["param_sum"] = float(global_params.double().sum())
    dist.destroy_process_group()
    return rounds


def _member_diloco(cfg: dict) -> list[dict]:
    """The project through its Python API (README: Python API), blocking, with its phases timed."""
    import torch

    import diloco
    from diloco.engine import diloco as engine_mod
    from diloco.engine.outer_state import OuterFragment
    from diloco.exchange.quorum_averager import QuorumAverager
    from diloco.exchange.quorum_pending import QuorumPending
    from diloco.exchange.striped import StripedAverager
    from diloco.job.config import TransportConfig

    spans = _Spans()
    spans.wrap(OuterFragment, "pseudo_gradient", "delta")
    spans.wrap(engine_mod.DiLoCo, "global_hash", "hash")
    spans.wrap(StripedAverager, "contribution_norm", "norm")
    spans.wrap(QuorumAverager, "_ask", "quorum")
    spans.wrap(QuorumAverager, "run_rings", "rings")
    spans.wrap(QuorumAverager, "vote", "vote")
    spans.wrap(QuorumPending, "wait", "wait")
    spans.wrap(StripedAverager, "land", "land")
    spans.wrap(OuterFragment, "outer_step", "outer")
    spans.wrap(OuterFragment, "merge_into_model", "merge")

    torch.set_num_threads(cfg["threads"])
    model, batch = _model_and_data(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    codec, _, dataplane = cfg["codec"].partition("@")
    codec, _, stage = codec.partition("+")  # fp32+zstd: the lossless zstd stage on every frame
    if stage not in ("", "zstd"):
        raise ValueError(f"unknown stage {stage!r} in {cfg['codec']!r}: only +zstd")
    settings = TransportConfig(host=cfg["host"], plaintext=True, codec=codec, link=dataplane or "tcp",
                               zstd=stage == "zstd", chunk_bytes=cfg["chunk_bytes"])
    rounds = []
    link = diloco.connect(cfg["coordinator"], group=cfg["group"], secret=cfg["secret"], token=cfg["token"],
                          settings=settings)
    with link, diloco.DiLoCo(model, opt, averager=link, sync_every=cfg["h"], mode="blocking") as engine:
        for r in range(cfg["warmup"] + cfg["rounds"]):
            for _ in range(cfg["h"] - 1):
                _inner_step(model, opt, batch)
                assert not engine.step()
            _inner_step(model, opt, batch)
            spans.take()
            w0, t0, c0, f0 = time.time(), time.perf_counter(), time.process_time(), _page_faults()
            events = engine.step()
            stall, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert any(e.kind == "commit" for e in events), events
            rounds.append({"round": r, "stall_s": stall, "cpu_s": cpu, "start": w0, "end": w0 + stall,
                           "page_faults": _page_faults() - f0, "spans": spans.take(), "bytes_sent": link.bytes_sent})
        rounds[-1]["param_hash"] = engine.global_hash()
    return rounds


def _member_main(cfg: dict) -> None:
    import torch

    torch.set_num_threads(cfg["threads"])
    rounds = (_member_gloo if cfg["backend"] == "gloo" else _member_diloco)(cfg)
    sys.stdout.write(json.dumps({"group": cfg["group"], "rounds": rounds}) + "\n")
    sys.stdout.flush()


# -- the driver --------------------------------------------------------------------------------------

def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _start_coordinator(host: str, groups: int, token: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port(host)
    env = {**os.environ, "DILOCO_TOKEN": token}
    cmd = [sys.executable, "-m", "diloco", "coordinator", "--host", host, "--port", str(port),
           "--groups", str(groups), "--keep-running"]
    if host != "127.0.0.1":
        cmd.append("--insecure-coordinator")
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return proc, f"{host}:{port}"
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited {proc.returncode}: {log.read_text()[-2000:]}")
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the coordinator did not listen within 60 s")


def run_case(link: str, groups: int, backend: str, codec: str, args, logdir: Path) -> dict:
    """One case: ``groups`` members on ``link``; every member's rounds."""
    from transport.netns import EmulatedWan

    rate = LINKS[link]
    wan = None if rate is None else EmulatedWan([None if rate == "unshaped" else rate] * groups)
    if wan is not None:
        wan.__enter__()
    procs, coord = [], None
    name = f"{link}-g{groups}-{backend}-{codec}"
    try:
        hosts = ["127.0.0.1"] * groups if wan is None else [wan.ip(g) for g in range(groups)]
        common = {"backend": backend, "groups": groups, "codec": codec, "h": args.h, "rounds": args.rounds,
                  "warmup": args.warmup, "batch": args.batch, "seq": args.seq, "lr": args.lr,
                  "threads": args.threads, "chunk_bytes": args.chunk_bytes}
        if backend == "gloo":
            common["gloo_master"] = f"{hosts[0]}:{_free_port(hosts[0]) if wan is None else 29511}"
        else:
            token = secrets.token_hex(16)
            coord, address = _start_coordinator("127.0.0.1" if wan is None else wan.gateway, groups, token,
                                                 logdir / f"{name}-coordinator.log")
            common.update(coordinator=address, token=token, secret=secrets.token_hex(32))
        for g in range(groups):
            cfg = {**common, "group": g, "host": hosts[g]}
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo" if wan is None else "eth0",
                   "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
            prefix = [] if wan is None else wan.exec_prefix(g)
            procs.append(subprocess.Popen(prefix + [sys.executable, __file__, "--member", json.dumps(cfg)],
                                          env=env, stdout=subprocess.PIPE, text=True,
                                          stderr=open(logdir / f"{name}-g{g}.log", "w"), cwd=ROOT))
        members = []
        for g, p in enumerate(procs):
            out, _ = p.communicate(timeout=args.case_timeout)
            if p.returncode != 0:
                raise RuntimeError(f"{name}: group {g} exited {p.returncode}; see {logdir}/{name}-g{g}.log")
            members.append(json.loads(out.strip().splitlines()[-1]))
        return {"link": link, "groups": groups, "backend": backend, "codec": codec, "members": members}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if coord is not None:
            coord.terminate()
            try:
                coord.wait(10)
            except subprocess.TimeoutExpired:
                coord.kill()
        if wan is not None:
            wan.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--member", help=argparse.SUPPRESS)
    ap.add_argument("--groups", default="2,3", help="group counts, comma-separated")
    ap.add_argument("--links", default="loopback,veth,1gbit", help=f"of {', '.join(LINKS)}")
    ap.add_argument("--codecs", default="fp32,int8",
                    help="the project's codecs (Gloo is fp32): NAME[+zstd][@LINK], e.g. fp32+zstd, fp32@grpc")
    ap.add_argument("--backends", default="gloo,diloco")
    ap.add_argument("--h", type=int, default=20, help="inner steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="counted rounds per case")
    ap.add_argument("--warmup", type=int, default=1, help="rounds not counted")
    ap.add_argument("--repeats", type=int, default=1, help="every case this many times, interleaved")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per member")
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="the project's ring chunk, bytes of fp32")
    ap.add_argument("--case-timeout", type=float, default=900.0)
    ap.add_argument("--logs", default="/tmp/sync_stall_logs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of these records and exit")
    ap.add_argument("--ab-report", metavar="JSON", help="print the before/after table of sync_stall_ab.json and exit")
    args = ap.parse_args()
    if args.report:
        print(report(args.report))
        return
    if args.ab_report:
        print(ab_report(args.ab_report))
        return
    if args.member:
        _member_main(json.loads(args.member))
        return
    logdir = Path(args.logs)
    logdir.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": MODEL, "cases": []}
    for rep in range(args.repeats):
        for link in args.links.split(","):
            for groups in (int(g) for g in args.groups.split(",")):
                for backend in args.backends.split(","):
                    for codec in (args.codecs.split(",") if backend == "diloco" else ["fp32"]):
                        case = run_case(link, groups, backend, codec, args, logdir)
                        case.update(repeat=rep, summary=summarize(case, args.warmup))
                        record["cases"].append(case)
                        s = case["summary"]
                        spans = " ".join(f"{k}={v:.3f}" for k, v in s["spans_median_s"].items())
                        print(f"{link:9s} G={groups} {backend:6s} {codec:5s} stall {s['stall_median_s']:.3f} s "
                              f"[{s['stall_min_s']:.3f}, {s['stall_max_s']:.3f}] after last arrival "
                              f"{s['after_last_median_s']:.3f} s [{s['after_last_min_s']:.3f}, "
                              f"{s['after_last_max_s']:.3f}] cpu/wall {s['cpu_per_wall']:.2f} {spans}",
                              flush=True)
                        if args.json:
                            Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
