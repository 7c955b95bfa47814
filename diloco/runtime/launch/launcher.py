"""``diloco run``: the embedded default, everything on one machine.

Starts a coordinator in this process and one ``torchrun`` job per worker group on loopback,
shows progress, stops every process it started if anything fails, and prints a summary.
On Kubernetes the same pieces run separately (``diloco coordinator``, ``diloco worker``).

Credentials: the job token and data-plane secret stay in this process. Each group gets only its
own (``endpoint.group_credentials``), so a group can be no other group, cannot stop the job and
cannot read ``/status``; the coordinator's ``/status`` asks for the job token, which the user
finds in ``RUN_DIR/coordinator-token`` (mode 0600, while the run lasts). Everything a group
starts listens on its ``--host``: its torchrun agent's rendezvous store and the workers' store
(``agent.bind_stores``), their Gloo, data plane and metrics.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diloco.coordinator import CoordinatorServer, rounds
from diloco.job.config import Config
from diloco.runtime.checkpoints import job_checkpoint
from diloco.runtime.checkpoints.job_checkpoint import ResumePoint
from diloco.runtime.launch import preflight, spare
from diloco.runtime.launch.agent import PARENT_ENV
from diloco.runtime.launch.chaos import ChaosMonkey, Drill
from diloco.runtime.launch.graceful_stop import GracefulStop, auto_stop_timeout, overdue_message, trained_since
from diloco.runtime.launch.link_relays import CorruptingRelays
from diloco.runtime.launch.summary import fault_summary, human_bytes, summarize
from diloco.runtime.launch.supervise import GroupFailed, Supervisor
from diloco.runtime.ops import exit_codes
from diloco.runtime.ops.processes import RUN_ID_ENV, end_trees
from diloco.runtime.rank.device_placement import DEVICE_MAP_ENV, DevicePlan, place_ranks
from diloco.runtime.rank.endpoint import SECRET_ENV, TOKEN_ENV, coordinator_tls, group_credentials, write_secret_file


STOP_GRACE_S = 3.0  # a hard stop: SIGTERM, then SIGKILL what is left after this long
STATUS_TOKEN_FILE = "coordinator-token"  # in the run dir: what diloco status --token-file reads


class LaunchError(RuntimeError):
    """A run could not start or a group failed; the message says which and why."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code  # what diloco run exits with (a group's own code when it failed)


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
        if not errors:
            return "\n".join(text[-lines:])
        return "\n".join([*last_traceback(text, limit=2 * lines), *errors[-lines:]])


def last_traceback(text: list[str], limit: int = 40) -> list[str]:
    """The last Python traceback among a log's lines (a rank prints one for an error in --entry code
    or a bug: ``user_errors``), its innermost ``limit`` lines; [] if there is none."""
    starts = [i for i, line in enumerate(text) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return []
    block = [text[starts[-1]]]
    for line in text[starts[-1] + 1:]:
        block.append(line)
        if line and not line[0].isspace():  # the exception's own line ends the traceback
            break
    return block if len(block) <= limit else [block[0], "  ...", *block[-(limit - 2):]]


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
                 placement: Placement, resume: Path | None = None, attempt: int = 0,
                 extra_args: list[str] | None = None) -> GroupProcess:
    log_path = _group_log(run_dir, group, attempt)
    cmd = [
        *placement.prefix(group), sys.executable, "-m", "diloco", "torchrun",
        *_rendezvous_args(placement.host(group) or cfg.transport.host),
        f"--nproc-per-node={cfg.topology.sizes()[group]}", "--monitor-interval=0.5",
        "--max-restarts=0",  # the supervisor restarts the whole group (see diloco/runtime/launch/supervise.py)
        "-m", "diloco", "worker", *_worker_args(cfg_path, cfg, group, coordinator, placement, resume, extra_args),
    ]
    log = open(log_path, "wb")
    env = {**env, PARENT_ENV: str(os.getpid())}  # the group's agent dies with this process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    return GroupProcess(group, proc, log_path)


def _rendezvous_args(host: str) -> list[str]:
    """torchrun's rendezvous for one group of ``diloco run``: this node alone, a new id each start,
    the rendezvous store and the workers' store at ``host`` (where ``diloco torchrun`` binds them:
    ``agent.bind_stores``; its workers' Gloo then uses ``host``'s interface), not every interface
    as ``--standalone``'s would."""
    endpoint = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}:0", f"--rdzv-id={uuid.uuid4().hex}",
            "--rdzv-conf=is_host=1", f"--local-addr={host}"]


def _group_log(run_dir: Path, group: int, attempt: int) -> Path:
    return run_dir / (f"group-{group}.log" if attempt == 0 else f"group-{group}.restart-{attempt}.log")


def _worker_args(cfg_path: Path, cfg: Config, group: int, coordinator: str, placement: Placement,
                 resume: Path | None = None, extra_args: list[str] | None = None) -> list[str]:
    """The arguments of ``diloco worker`` for one group (after ``worker``)."""
    host = placement.host(group)
    return [
        "--config", str(cfg_path), "--group-id", str(group), "--coordinator", coordinator,
        *(["--host", host] if host else []),
        *(["--resume", str(resume)] if resume is not None else []),
        *(["--metrics-port", str(cfg.train.metrics_port + sum(cfg.topology.sizes()[:group]))]
          if cfg.train.metrics_port else []),
        *data_port_args(cfg, group),
        *(extra_args or []),
    ]


def data_port_args(cfg: Config, group: int) -> list[str]:
    """``--data-port`` (and a port of ``--advertise-address``) for ``group`` under ``diloco run``:
    the groups share one host, so group g's ranks take the ports after the earlier groups' ranks
    (``--data-port`` + the ranks of groups 0..g-1 + the local rank), as ``--metrics-port`` does."""
    t = cfg.transport
    if not t.data_port:
        return []
    offset = sum(cfg.topology.sizes()[:group])
    out = ["--data-port", str(t.data_port + offset)]
    host, sep, port = t.advertise_address.rpartition(":")
    if t.advertise_address and sep and port.isdigit() and "]" not in port:
        out += ["--advertise-address", f"{host}:{int(port) + offset}"]
    return out


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
        chaos: Drill | None = None, fit_ranks: bool = False, stop_timeout_s: float | None = None) -> dict:
    """Run a whole job on this machine; returns the summary dict (see ``summary.format_summary``).
    ``resume``: continue from this job checkpoint (``job_checkpoint.find``; ``cfg`` from
    ``job_checkpoint.resume_config``). ``chaos``: a fault drill (default: ``--chaos N`` kills).
    Groups that fail for a fault are started again (``--max-restarts``) and heal. Job checkpoints
    go to ``--checkpoint-dir``, by default ``RUN_DIR/checkpoints``. Each rank gets its device from
    ``place_devices`` (``fit_ranks``: fewer ranks per group where the host has fewer GPUs, rather
    than an error). A drill with ``corrupt`` faults puts a relay in front of every group
    (``link_relays``; groups on this host's loopback only).

    In the main thread, the first SIGINT or SIGTERM asks every group to checkpoint at its next
    exchange and stop (the summary then says how to resume), within ``stop_timeout_s`` (None: 3
    rounds, within ``STOP_TIMEOUT_BOUNDS_S``); a second signal, or that deadline, ends every
    process at once. However it ends, ``run`` returns only after every process it started is gone.
    """
    placement = placement or Placement()
    corpus = preflight.check_workload(cfg)
    preflight.check_run_paths(cfg, run_dir=run_dir)
    cfg, devices = place_devices(cfg, fit_ranks=fit_ranks)
    out_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="diloco-run-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.train.checkpoint_dir:  # where a stop (Ctrl-C, SIGTERM) leaves a checkpoint to resume from
        cfg = copy.deepcopy(cfg)
        cfg.train.checkpoint_dir = str((out_dir / "checkpoints").resolve())
    cfg_path = out_dir / "config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    token = secrets.token_hex(16)
    run_id = secrets.token_hex(8)
    env = dict(os.environ)
    env[SECRET_ENV] = secrets.token_hex(32)
    env[TOKEN_ENV] = token
    env[RUN_ID_ENV] = run_id
    env.setdefault("OMP_NUM_THREADS", str(cfg.topology.threads_per_rank or 1))  # 0: each rank's share, 1 here
    host = placement.coordinator_host or cfg.transport.host
    server = CoordinatorServer(
        host=host, port=0, expected_groups=cfg.topology.groups, token=token,
        tls=coordinator_tls(cfg.transport, f"{host}:0"), allow_insecure=cfg.transport.plaintext,
        join_timeout_s=max(cfg.transport.timeout_s, 120.0), heartbeat_timeout_s=cfg.fault.heartbeat_timeout,
        min_groups=cfg.fault.min_groups, outlier_factor=cfg.fault.outlier_factor,
        quorum_grace_s=cfg.fault.quorum_grace, checkpoint_hint=cfg.train.checkpoint_dir,
    )
    if chaos is None and cfg.fault.chaos:
        hb = cfg.fault.heartbeat_timeout
        chaos = ChaosMonkey(cfg.fault.chaos, seed=cfg.train.seed, gap_s=(hb, 3 * hb), pause_s=(0.5, hb),
                            kinds=cfg.fault.kinds(), stall_s=(2 * hb, 3 * hb))
    if cfg.fault.spares and any(placement.prefix(g) or placement.host(g) for g in range(cfg.topology.groups)):
        raise LaunchError("--spares are started on this host as plain processes: they cannot replace groups placed in "
                          "network namespaces or on other hosts", exit_codes.CONFIGURATION)
    relays = _relays(cfg, chaos, placement)
    address = server.start()
    try:
        http = _serve_coordinator_http(cfg, server, placement, token, out_dir / STATUS_TOKEN_FILE)
    except BaseException:
        server.stop()
        if relays is not None:
            relays.close()
        raise
    bar = _Progress(cfg.train.steps, progress, start=resume.step if resume is not None else 0)
    started = time.perf_counter()

    job_secret = bytes.fromhex(env[SECRET_ENV])

    def group_env(g: int) -> dict[str, str]:
        # each group gets only its own credentials: it can prove it is group g, and be nobody else
        own = {**env, **group_credentials(token, job_secret, g, cfg.topology.groups)}
        own.pop(DEVICE_MAP_ENV, None)
        if devices.device_map(g) is not None:
            own[DEVICE_MAP_ENV] = devices.device_map(g)
        return own

    def spawn(g: int, attempt: int) -> GroupProcess:  # a restarted group heals: it does not resume
        point = resume.path.resolve() if resume is not None and attempt == 0 else None
        return _spawn_group(cfg_path, cfg, g, address, group_env(g), out_dir, placement, resume=point,
                            attempt=attempt, extra_args=relays.args(g) if relays is not None else None)

    # warm spares: the job's environment without any group's credentials, which come with the assignment
    spare_env = {k: v for k, v in env.items() if k not in (SECRET_ENV, TOKEN_ENV, DEVICE_MAP_ENV)}
    spare_env[PARENT_ENV] = str(os.getpid())
    spares_started = itertools.count()

    def assign(s: spare.Spare, g: int, attempt: int) -> GroupProcess:
        log_path = _group_log(out_dir, g, attempt)
        args = _worker_args(cfg_path, cfg, g, address, placement, None, relays.args(g) if relays is not None else None)
        try:
            spare.hand_over(s, args, {k: v for k, v in group_env(g).items() if spare_env.get(k) != v}, log_path)
        except OSError as e:  # it died since it was polled: start the group the usual way
            logging.getLogger("diloco.run").warning("spare %s is gone (%s); starting group %d anew", s.log_path, e, g)
            return spawn(g, attempt)
        return GroupProcess(g, s.proc, log_path)

    supervisor = Supervisor(spawn, cfg.topology.groups, cfg.fault.max_restarts, chaos,
                            corrupt_link=relays.corrupt if relays is not None else None, spares=cfg.fault.spares,
                            start_spare=lambda: spare.start(spare_env, out_dir / f"spare-{next(spares_started)}.log",
                                                            cfg_path),
                            assign=assign, on_exit=server.group_exited)
    start_step = resume.step if resume is not None else 0
    stop = GracefulStop(server, lambda: stop_timeout_s if stop_timeout_s is not None else auto_stop_timeout(
        server.snapshot(), time.perf_counter() - started),
        trained=lambda: trained_since(server.snapshot(), start_step),
        newest_checkpoint=lambda: job_checkpoint.latest_complete_step(cfg.train.checkpoint_dir))
    stop.install()
    try:
        supervisor.start()
        while True:
            snapshot = server.snapshot()
            bar.update(snapshot)
            if snapshot["rounds_state"].get("job_lost"):  # before any group is restarted into it
                raise LaunchError(job_lost_message(snapshot["rounds_state"]["job_lost"], cfg), exit_codes.RESTART)
            if snapshot["rounds_state"].get("halted"):  # every group stops with exit 2: no restart mends it
                raise LaunchError(f"the job halted: {snapshot['rounds_state']['halted']}", exit_codes.CONFIGURATION)
            try:
                rs = snapshot["rounds_state"]
                if supervisor.poll(live=set(rs["live_groups"]), progress=_job_progress(snapshot, cfg.train.steps),
                                   committed=rs["committed_training"]):
                    break
            except GroupFailed as e:
                raise LaunchError(f"{e}\nstopped all groups.", e.code) from None
            if timeout_s is not None and time.perf_counter() - started > timeout_s:
                raise LaunchError(f"run exceeded its {timeout_s:.0f} s limit; stopped all groups (logs in {out_dir})")
            if stop.overdue():
                raise LaunchError(overdue_message(stop, cfg.train.checkpoint_dir, out_dir), exit_codes.INTERRUPTED)
            time.sleep(0.1 if chaos is not None else 0.25)
        summaries = server.wait_for_summaries(cfg.topology.groups, timeout_s=10.0)
        bar.update(server.snapshot())
        snapshot = server.snapshot()
    finally:
        stop.ending.set()  # from here a signal only hurries the end: it never interrupts it
        bar.close()
        left = end_trees([g.proc for g in supervisor.all_procs()], grace_s=STOP_GRACE_S, run_id=run_id,
                         hurry=stop.hurry)
        server.stop()
        if http is not None:
            http.close()
            (out_dir / STATUS_TOKEN_FILE).unlink(missing_ok=True)  # the token opens nothing now
        if relays is not None:
            relays.close()
        stop.restore()
        if left:
            logging.getLogger("diloco.run").error("processes %s of this run did not end after SIGKILL", left)
    per_group = [summaries[g] for g in sorted(summaries) if rounds.summary_kind(summaries[g]) != rounds.LATE]
    if not per_group:
        raise LaunchError("no group finished the job (every summary came from a group that joined too late)")
    summary = summarize(cfg, corpus, per_group, snapshot, time.perf_counter() - started, out_dir)
    summary["fault"] = fault_summary(snapshot, supervisor)
    summary["placement"] = devices.describe()
    summary["summaries"] = summaries
    if stop.signal_name is not None and summary.get("stopped_at_step") is not None:
        summary["interrupted"] = stop.signal_name  # diloco run exits 130: the job is not finished
    return summary


def _relays(cfg: Config, chaos: Drill | None, placement: Placement) -> CorruptingRelays | None:
    """The relays of a drill with ``corrupt`` faults (None without; a drill of the caller's own, any
    object with ``tick``, has them if its ``kinds`` say so); LaunchError where they cannot go."""
    if chaos is None or "corrupt" not in getattr(chaos, "kinds", ()):
        return None
    if set(cfg.topology.sizes()) != {1} or cfg.transport.data_port or cfg.transport.advertise_address:
        raise LaunchError("corrupt faults put a relay in front of each group's data plane: they need groups of one "
                          "rank and no --data-port or --advertise-address", exit_codes.CONFIGURATION)
    if any(placement.prefix(g) or placement.host(g) for g in range(cfg.topology.groups)):
        raise LaunchError("corrupt faults need every group on this host's loopback (the relays listen there)",
                          exit_codes.CONFIGURATION)
    return CorruptingRelays(cfg.topology.groups, host=cfg.transport.host, seed=cfg.train.seed)


def job_lost_message(lost: str, cfg: Config) -> str:
    """``diloco run``'s words when every group was lost at once: the coordinator's, and the command
    that resumes the job from its newest complete checkpoint (if any)."""
    root = cfg.train.checkpoint_dir
    step = job_checkpoint.latest_complete_step(root) if root else None
    how = (f"resume: diloco run --resume {root} (newest complete step: {step})" if step is not None
           else f"no complete job checkpoint under {root or '(no --checkpoint-dir)'}: start again")
    return f"{lost}\n{how}; exit {exit_codes.describe(exit_codes.RESTART)}"


def _job_progress(snapshot: dict, steps: int) -> float:
    """Fraction of the job's steps done by the slowest reporting group (0 before any report)."""
    done = [int(p.get("step", 0)) for p in snapshot.get("progress", {}).values()]
    return min(done) / steps if done and steps else 0.0


def _serve_coordinator_http(cfg: Config, server: CoordinatorServer, placement: Placement, token: str,
                            token_file: Path):
    """With ``--metrics-port N``: the coordinator's /metrics, /status and /healthz on the port after
    the ranks' (N + every rank), ``/status`` only with the job ``token``, which goes to
    ``token_file`` (mode 0600) for ``diloco status --token-file``; else None."""
    if not cfg.train.metrics_port:
        return None
    from diloco.coordinator import metrics as coordinator_metrics

    host = placement.coordinator_host or cfg.transport.host
    write_secret_file(token_file, token)
    try:
        http = coordinator_metrics.serve(server, host=host, port=cfg.train.metrics_port + sum(cfg.topology.sizes()),
                                         token=token)
    except BaseException:
        token_file.unlink(missing_ok=True)
        raise
    logging.getLogger("diloco.run").info("coordinator metrics on http://%s:%d/metrics, status: "
                                         "diloco status --address %s:%d --token-file %s", host, http.port, host,
                                         http.port, token_file)
    return http
