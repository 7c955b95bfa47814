"""``diloco run``: the embedded default, everything on one machine.

Starts a coordinator in this process and one ``torchrun`` job per worker group on loopback,
shows progress, stops every process it started if anything fails, and prints a summary.
On Kubernetes the same pieces run separately (``diloco coordinator``, ``diloco worker``).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diloco import data as data_mod
from diloco.config import Config
from diloco.coordinator import CoordinatorServer
from diloco.connection import SECRET_ENV, TOKEN_ENV
from diloco.task import DEMO_ENTRY, load_entry, parse_entry_args


class LaunchError(RuntimeError):
    """A run could not start or a group failed; the message says which and why."""


@dataclass
class GroupProcess:
    group: int
    proc: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 20) -> str:
        """The workers' own error lines if any (torchrun's report follows them), else the log's end."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [line for line in text if line.startswith("diloco worker (")]
        return "\n".join(errors[-lines:] if errors else text[-lines:])


def preflight(cfg: Config) -> data_mod.Corpus | None:
    """Check everything that can be checked before a process starts (config; the demo's data,
    or that a user's ``--entry`` imports and is callable)."""
    cfg.validate()
    if cfg.train.entry:
        parse_entry_args(cfg.train.entry_args)
        load_entry(cfg.train.entry)
        return None
    corpus = data_mod.load_corpus(cfg.data.path or None)
    train, val = data_mod.split(corpus, cfg.data.val_fraction)
    data_mod.check_feedable(len(train), cfg.topology.groups, cfg.model.block_size, what="training")
    data_mod.check_feedable(len(val), 1, cfg.model.block_size, what="validation")
    if corpus.vocab_size > 65536:
        raise data_mod.DataError(f"vocabulary of {corpus.vocab_size} tokens is too large")
    return corpus


def dp_bytes(num_parameters: int, groups: int, steps: int, bytes_per_value: int = 4) -> int:
    """Bytes all groups together would send if they all-reduced fp32 gradients every step.

    A bandwidth-optimal ring moves ``2(G-1)/G`` of the vector per group per step.
    """
    if groups < 2:
        return 0
    return 2 * (groups - 1) * num_parameters * bytes_per_value * steps


@dataclass(frozen=True)
class Placement:
    """Where each group runs: a command prefix (e.g. ``ip netns exec NS``) and its listen host.

    The default runs every group directly on this machine at ``--host``; the benchmarks put each
    group in its own network namespace of a ``transport.netns.EmulatedWan``.
    """

    prefix: Callable[[int], list[str]] = lambda group: []
    host: Callable[[int], str | None] = lambda group: None
    coordinator_host: str | None = None


def _spawn_group(cfg_path: Path, cfg: Config, group: int, coordinator: str, env: dict, run_dir: Path,
                 placement: Placement) -> GroupProcess:
    log_path = run_dir / f"group-{group}.log"
    host = placement.host(group)
    cmd = [
        *placement.prefix(group), sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={cfg.topology.sizes()[group]}", "--monitor-interval=0.5",
        "-m", "diloco", "worker", "--config", str(cfg_path),
        "--group-id", str(group), "--coordinator", coordinator,
        *(["--host", host] if host else []),
        *(["--metrics-port", str(cfg.train.metrics_port + sum(cfg.topology.sizes()[:group]))]
          if cfg.train.metrics_port else []),
    ]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    return GroupProcess(group, proc, log_path)


def _descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (Linux /proc), children first found first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # the process ended while we listed /proc
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # already gone: nothing to signal
            pass


def _stop(groups: list[GroupProcess], grace_s: float = 5.0) -> None:
    """Stop every group's whole process tree: SIGTERM, then SIGKILL what is left after grace_s."""
    trees = {g.proc.pid: [g.proc.pid, *_descendants(g.proc.pid)] for g in groups if g.proc.poll() is None}
    for pids in trees.values():
        _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for g in groups:
        try:
            g.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:  # still running: killed below
            pass
    for pids in trees.values():  # torchrun may be gone while a worker of it is not
        _signal(pids, signal.SIGKILL)
    for g in groups:
        g.proc.wait()


class _Progress:
    """A tqdm bar over group 0's reported steps (or silent when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc="diloco")
        self.done = 0

    def update(self, snapshot: dict) -> None:
        progress = snapshot.get("progress", {})
        if self.bar is None or not progress:
            return
        steps = [int(p.get("step", 0)) for p in progress.values()]
        step = min(steps) if len(progress) > 1 else steps[0]
        first = progress[min(progress)]
        sent = sum(int(p.get("bytes_sent", 0)) for p in progress.values())
        self.bar.set_postfix(
            loss=first.get("loss"), tok_s=f"{sum(float(p.get('tokens_per_s', 0)) for p in progress.values()):.0f}",
            round=first.get("round"), H=first.get("h"), sent=_human_bytes(sent), refresh=False,
        )
        if step > self.done:
            self.bar.update(step - self.done)
            self.done = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n}"


def run(cfg: Config, *, run_dir: str | None = None, progress: bool = True, timeout_s: float | None = None,
        placement: Placement | None = None) -> dict:
    """Run a whole job on this machine; returns the summary dict (see ``format_summary``)."""
    placement = placement or Placement()
    corpus = preflight(cfg)
    out_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="diloco-run-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    token = secrets.token_hex(16)
    env = dict(os.environ)
    env[SECRET_ENV] = secrets.token_hex(32)
    env[TOKEN_ENV] = token
    env.setdefault("OMP_NUM_THREADS", str(cfg.topology.threads_per_rank))
    server = CoordinatorServer(
        host=placement.coordinator_host or cfg.transport.host, port=0,
        expected_groups=cfg.topology.groups, token=token,
        join_timeout_s=max(cfg.transport.timeout_s, 120.0),
    )
    address = server.start()
    groups: list[GroupProcess] = []
    bar = _Progress(cfg.train.steps, progress)
    started = time.perf_counter()
    try:
        for g in range(cfg.topology.groups):
            groups.append(_spawn_group(cfg_path, cfg, g, address, env, out_dir, placement))
        while True:
            codes = [g.proc.poll() for g in groups]
            failed = [g for g, c in zip(groups, codes) if c not in (None, 0)]
            if failed:
                f = failed[0]
                raise LaunchError(
                    f"group {f.group} exited with code {f.proc.returncode}; stopped all groups. "
                    f"Last lines of {f.log_path}:\n{f.tail()}"
                )
            bar.update(server.snapshot())
            if all(c == 0 for c in codes):
                break
            if timeout_s is not None and time.perf_counter() - started > timeout_s:
                raise LaunchError(f"run exceeded its {timeout_s:.0f} s limit; stopped all groups (logs in {out_dir})")
            time.sleep(0.25)
        summaries = server.wait_for_summaries(cfg.topology.groups, timeout_s=10.0)
        bar.update(server.snapshot())
        snapshot = server.snapshot()
    finally:
        bar.close()
        _stop(groups)
        server.stop()
    return _summarize(cfg, corpus, summaries, snapshot, time.perf_counter() - started, out_dir)


def _summarize(cfg: Config, corpus, summaries: dict, snapshot: dict, seconds: float, out_dir: Path) -> dict:
    per_group = [summaries[g] for g in sorted(summaries)]
    n = int(per_group[0]["num_parameters"])
    sent = sum(int(s["bytes_sent"]) for s in per_group)
    dp = dp_bytes(n, cfg.topology.groups, cfg.train.steps)
    hashes = {int(s["group"]): s["param_hash"] for s in per_group}
    return {
        "eval_loss": per_group[0]["eval_loss"],
        "eval_loss_per_group": {int(s["group"]): s["eval_loss"] for s in per_group},
        "initial_eval_loss": per_group[0]["initial_eval_loss"],
        "round_hashes_per_group": {int(s["group"]): s["round_hashes"] for s in per_group},
        "outer_rounds": per_group[0]["outer_rounds"],
        "inner_steps": per_group[0]["inner_steps"],
        "periods": per_group[0]["periods"],
        "groups": cfg.topology.groups,
        "ranks_per_group": cfg.topology.sizes(),
        "num_parameters": n,
        "tokens": sum(int(s["tokens"]) for s in per_group),
        "bytes_sent": sent,
        "dp_bytes": dp,
        "reduction_vs_dp": (dp / sent) if sent else None,
        "param_hash_per_group": hashes,
        "params_identical": len(set(hashes.values())) == 1,
        "divergence": snapshot.get("divergence", []),
        "seconds": seconds,
        "sync_seconds_per_group": {int(s["group"]): s["sync_seconds"] for s in per_group},
        "utilization": min(float(s["utilization"]) for s in per_group),
        "utilization_per_group": {int(s["group"]): s["utilization"] for s in per_group},
        "mode": per_group[0]["mode"],
        "fragments": per_group[0]["fragments"],
        "corpus": corpus.source if corpus is not None else None,
        "entry": cfg.train.entry or DEMO_ENTRY,
        "run_dir": str(out_dir),
        "config": cfg.to_dict(),
    }


def format_summary(s: dict) -> str:
    """Human-readable summary block printed at the end of ``diloco run``."""
    lines = [
        "diloco run summary",
        f"  eval loss (global model) : {s['eval_loss']:.4f}{' nats/token' if s.get('entry') == DEMO_ENTRY else ''}"
        f" (initial {s['initial_eval_loss']:.4f})",
        f"  trained                  : {s.get('entry', DEMO_ENTRY)}",
        f"  sync mode                : {s['mode']}, {s['fragments']} fragment(s)",
        f"  outer rounds             : {s['outer_rounds']} (H per round: {_compact(s['periods'])})",
        f"  inner steps per rank     : {s['inner_steps']}",
        f"  groups (ranks each)      : {s['groups']} ({', '.join(map(str, s['ranks_per_group']))})",
        f"  parameters               : {s['num_parameters']:,}",
        f"  bytes between groups     : {_human_bytes(s['bytes_sent'])} ({s['bytes_sent']:,} B)",
        f"  data parallel would send : {_human_bytes(s['dp_bytes'])} ({s['dp_bytes']:,} B)"
        + (f", {s['reduction_vs_dp']:.0f}x more" if s["reduction_vs_dp"] else ""),
        f"  global params identical  : {s['params_identical']} ({', '.join(s['param_hash_per_group'].values())})",
        f"  compute utilization      : {100 * s['utilization']:.1f}% (time in inner steps / wall, slowest group)",
        f"  wall time                : {s['seconds']:.1f} s",
        f"  logs                     : {s['run_dir']}",
    ]
    return "\n".join(lines)


def _compact(periods: list[int]) -> str:
    if len(set(periods)) == 1:
        return f"{periods[0]} x{len(periods)}"
    return ", ".join(map(str, periods[:12])) + (" ..." if len(periods) > 12 else "")
