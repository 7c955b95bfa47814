"""``diloco run``: the embedded default, everything on one machine.

Starts a coordinator in this process and one ``torchrun`` job per worker group on loopback,
shows progress, stops every process it started if anything fails, and prints a summary.
On Kubernetes the same pieces run separately (``diloco coordinator``, ``diloco worker``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diloco.coordinator import CoordinatorServer
from diloco.coordinator.credentials import group_token
from diloco.demo import data as data_mod
from diloco.job.config import Config
from diloco.job.task import load_entry, parse_entry_args
from diloco.runtime.chaos import ChaosMonkey
from diloco.runtime.connection import SECRET_ENV, TOKEN_ENV, coordinator_tls
from diloco.runtime.device_placement import DEVICE_MAP_ENV, DevicePlan, place_ranks
from diloco.runtime.job_checkpoint import ResumePoint
from diloco.runtime.summary import fault_summary, human_bytes, summarize
from diloco.runtime.supervise import GroupFailed, Supervisor, descendants
from transport.identity import GroupKeys


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


def place_devices(cfg: Config, *, fit_ranks: bool = False) -> tuple[Config, DevicePlan]:
    """``(config, plan)``: where every rank of every group runs on this host (see
    ``device_placement.place_ranks``; the GPUs are ``torch.cuda.device_count()`` when the backend
    resolves to nccl). ``fit_ranks``: a group with more ranks than GPUs is cut to the GPU count and
    the returned config says so (else a PlacementError, before any process starts)."""
    import torch

    backend = cfg.topology.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    gpus = torch.cuda.device_count() if backend == "nccl" and torch.cuda.is_available() else 0
    plan = place_ranks(gpus, cfg.topology.sizes(), backend=backend, fit=fit_ranks)
    if plan.reduced:
        cfg = copy.deepcopy(cfg)
        if cfg.topology.group_sizes:
            cfg.topology.group_sizes = ",".join(map(str, plan.sizes))
        else:
            cfg.topology.ranks_per_group = plan.sizes[0]
        logging.getLogger("diloco.run").warning("placement: %s", plan.describe())
    return cfg, plan


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
                 placement: Placement, resume: Path | None = None, attempt: int = 0) -> GroupProcess:
    log_path = run_dir / (f"group-{group}.log" if attempt == 0 else f"group-{group}.restart-{attempt}.log")
    host = placement.host(group)
    cmd = [
        *placement.prefix(group), sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={cfg.topology.sizes()[group]}", "--monitor-interval=0.5",
        "--max-restarts=0",  # the supervisor restarts the whole group (see diloco/runtime/supervise.py)
        "-m", "diloco", "worker", "--config", str(cfg_path),
        "--group-id", str(group), "--coordinator", coordinator,
        *(["--host", host] if host else []),
        *(["--resume", str(resume)] if resume is not None else []),
        *(["--metrics-port", str(cfg.train.metrics_port + sum(cfg.topology.sizes()[:group]))]
          if cfg.train.metrics_port else []),
    ]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    return GroupProcess(group, proc, log_path)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # already gone: nothing to signal
            pass


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text`` (e.g. a run folder): what a
    run leaked if any are left after it ended."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # ended while we looked
                continue
            if text in cmdline and state != "Z":
                out.append(int(entry.name))
    return out


def _stop(groups: list[GroupProcess], grace_s: float = 5.0) -> None:
    """Stop every group's whole process tree: SIGTERM, then SIGKILL what is left after grace_s."""
    trees = {g.proc.pid: [g.proc.pid, *descendants(g.proc.pid)] for g in groups if g.proc.poll() is None}
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

    def __init__(self, total: int, enabled: bool, start: int = 0) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, desc="diloco")
        self.done = start

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
            round=first.get("round"), H=first.get("h"), sent=human_bytes(sent), refresh=False,
        )
        if step > self.done:
            self.bar.update(step - self.done)
            self.done = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(cfg: Config, *, run_dir: str | None = None, progress: bool = True, timeout_s: float | None = None,
        placement: Placement | None = None, resume: ResumePoint | None = None,
        chaos: ChaosMonkey | None = None, fit_ranks: bool = False) -> dict:
    """Run a whole job on this machine; returns the summary dict (see ``format_summary``).
    ``resume``: continue from this job checkpoint (``job_checkpoint.find``; ``cfg`` from
    ``job_checkpoint.resume_config``). ``chaos``: a fault drill (default: ``--chaos N`` kills).
    Groups that fail are started again (``--max-restarts``) and heal. With checkpoints on and no ``--checkpoint-dir``, they go
    to ``RUN_DIR/checkpoints``. Each rank gets its device from ``place_devices`` (``fit_ranks``:
    fewer ranks per group where the host has fewer GPUs, rather than an error)."""
    placement = placement or Placement()
    corpus = preflight(cfg)
    cfg, devices = place_devices(cfg, fit_ranks=fit_ranks)
    out_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="diloco-run-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.train.checkpoint_dir and (cfg.train.checkpoint_every or cfg.train.stop_after):
        cfg = copy.deepcopy(cfg)
        cfg.train.checkpoint_dir = str((out_dir / "checkpoints").resolve())
    cfg_path = out_dir / "config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    token = secrets.token_hex(16)
    env = dict(os.environ)
    env[SECRET_ENV] = secrets.token_hex(32)
    env[TOKEN_ENV] = token
    env.setdefault("OMP_NUM_THREADS", str(cfg.topology.threads_per_rank))
    host = placement.coordinator_host or cfg.transport.host
    server = CoordinatorServer(
        host=host, port=0, expected_groups=cfg.topology.groups, token=token,
        tls=coordinator_tls(cfg.transport, f"{host}:0"), allow_insecure=cfg.transport.plaintext,
        join_timeout_s=max(cfg.transport.timeout_s, 120.0), heartbeat_timeout_s=cfg.fault.heartbeat_timeout,
        min_groups=cfg.fault.min_groups, outlier_factor=cfg.fault.outlier_factor,
    )
    if chaos is None and cfg.fault.chaos:
        hb = cfg.fault.heartbeat_timeout
        chaos = ChaosMonkey(cfg.fault.chaos, seed=cfg.train.seed, gap_s=(hb, 3 * hb), pause_s=(0.5, hb))
    address = server.start()
    try:
        http = _serve_coordinator_http(cfg, server, placement)
    except BaseException:
        server.stop()
        raise
    bar = _Progress(cfg.train.steps, progress, start=resume.step if resume is not None else 0)
    started = time.perf_counter()

    job_secret = bytes.fromhex(env[SECRET_ENV])

    def spawn(g: int, attempt: int) -> GroupProcess:  # a restarted group heals: it does not resume
        point = resume.path.resolve() if resume is not None and attempt == 0 else None
        # each group gets only its own credentials: it can prove it is group g, and be nobody else
        own = {**env, SECRET_ENV: GroupKeys.derive(job_secret, g, peers=range(cfg.topology.groups)).to_text(),
               TOKEN_ENV: group_token(token, g)}
        own.pop(DEVICE_MAP_ENV, None)
        if devices.device_map(g) is not None:
            own[DEVICE_MAP_ENV] = devices.device_map(g)
        return _spawn_group(cfg_path, cfg, g, address, own, out_dir, placement, resume=point, attempt=attempt)

    supervisor = Supervisor(spawn, cfg.topology.groups, cfg.fault.max_restarts, chaos)
    restore_sigterm = _stop_on_sigterm(server, checkpoints=bool(cfg.train.checkpoint_dir))
    try:
        supervisor.start()
        while True:
            snapshot = server.snapshot()
            bar.update(snapshot)
            try:
                rs = snapshot["rounds_state"]
                if supervisor.poll(live=set(rs["live_groups"]), progress=_job_progress(snapshot, cfg.train.steps),
                                   committed=rs["committed_training"]):
                    break
            except GroupFailed as e:
                raise LaunchError(f"{e}\nstopped all groups.") from None
            if timeout_s is not None and time.perf_counter() - started > timeout_s:
                raise LaunchError(f"run exceeded its {timeout_s:.0f} s limit; stopped all groups (logs in {out_dir})")
            time.sleep(0.1 if chaos is not None else 0.25)
        summaries = server.wait_for_summaries(cfg.topology.groups, timeout_s=10.0)
        bar.update(server.snapshot())
        snapshot = server.snapshot()
    finally:
        restore_sigterm()
        bar.close()
        _stop(supervisor.all_procs())
        server.stop()
        if http is not None:
            http.close()
    per_group = [summaries[g] for g in sorted(summaries) if not summaries[g].get("joined_late")]
    if not per_group:
        raise LaunchError("no group finished the job (every summary came from a group that joined too late)")
    summary = summarize(cfg, corpus, per_group, snapshot, time.perf_counter() - started, out_dir)
    summary["fault"] = fault_summary(snapshot, supervisor)
    summary["placement"] = devices.describe()
    summary["summaries"] = summaries
    return summary


def _stop_on_sigterm(server: CoordinatorServer, *, checkpoints: bool) -> Callable[[], None]:
    """With job checkpoints on, a first SIGTERM asks every group, through the coordinator, to
    checkpoint at the same step and stop (``diloco run --resume`` continues); a second one, or
    any SIGTERM without checkpoints, stops every process at once. Returns what restores the
    previous handler. Only in the main thread (signals can be handled nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    asked = []

    def handler(signum, frame) -> None:
        if checkpoints and not asked:
            asked.append(True)
            logging.getLogger("diloco.run").warning(
                "SIGTERM: every group checkpoints at its next exchange and stops (SIGTERM again: stop now)")
            server.request_stop("SIGTERM to diloco run")
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _job_progress(snapshot: dict, steps: int) -> float:
    """Fraction of the job's steps done by the slowest reporting group (0 before any report)."""
    done = [int(p.get("step", 0)) for p in snapshot.get("progress", {}).values()]
    return min(done) / steps if done and steps else 0.0


def _serve_coordinator_http(cfg: Config, server: CoordinatorServer, placement: Placement):
    """With ``--metrics-port N``: the coordinator's /metrics, /status and /healthz on the port after
    the ranks' (N + every rank); else None."""
    if not cfg.train.metrics_port:
        return None
    from diloco.coordinator import metrics as coordinator_metrics

    host = placement.coordinator_host or cfg.transport.host
    http = coordinator_metrics.serve(server, host=host, port=cfg.train.metrics_port + sum(cfg.topology.sizes()))
    logging.getLogger("diloco.run").info("coordinator metrics on http://%s:%d/metrics, status: "
                                         "diloco status --address %s:%d", host, http.port, host, http.port)
    return http
