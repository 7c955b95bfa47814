"""The ``diloco`` command: ``run`` (embedded default), ``worker`` (under torchrun), ``torchrun``,
``coordinator``, ``status``, ``credentials``. Exit codes: ``diloco.runtime.ops.exit_codes`` (0 done, 1 error, 2
configuration, 75 restart me, 130 interrupted)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from diloco.cli_parser import build_parser
from diloco.job import config as config_mod
from diloco.job import config_parse
from diloco.runtime.ops import exit_codes, logs, stack_dumps

def _config(args: argparse.Namespace, group: int | None = None) -> tuple[config_mod.Config, Any]:
    """``(config, resume point or None)``: from the flags, or with ``--resume`` from the checkpoint
    with the flags' operational settings (``checkpoint_index.resume_config``)."""
    if not args.resume:
        return config_parse.from_args(args), None
    from diloco.runtime.checkpoints import checkpoint_index  # torch-free: a bad path is refused at once

    point = checkpoint_index.find(args.resume, group=group)
    if group is None:  # diloco run: every file is checked before any process starts
        try:
            checkpoint_index.verify_step(point.path)
        except checkpoint_index.CheckpointError as e:
            older = checkpoint_index.newest_intact_step(point.root, below=point.step)
            hint = (f"; the newest intact step before it is {older.name}: diloco run --resume {older}" if older
                    else "; no older step under it is intact")
            raise checkpoint_index.CheckpointError(f"{e}{hint}") from None
    cfg = checkpoint_index.resume_config(point.config, config_parse.explicit_settings(args), point.root, point.step)
    return cfg, point


def _resume_auto(args: argparse.Namespace) -> None:
    """``diloco run --resume auto``: the newest checkpoint every group completed in the run's
    checkpoint folder (``--checkpoint-dir``, else ``RUN_DIR/checkpoints``) if there is one, else a
    fresh start; says which. Sets ``args.resume`` to that folder or None."""
    from pathlib import Path

    from diloco.runtime.checkpoints import checkpoint_index

    root = config_parse.from_args(args).train.checkpoint_dir or (
        str(Path(args.run_dir) / "checkpoints") if args.run_dir else "")
    if not root:
        raise config_mod.ConfigError("--resume auto needs --run-dir or --checkpoint-dir (where the run's "
                                     "checkpoints are)")
    step = checkpoint_index.latest_complete_step(root) if Path(root).is_dir() else None
    if step is None:
        print(f"diloco run: --resume auto: no complete checkpoint under {root}; starting fresh", file=sys.stderr,
              flush=True)
        args.resume = None
    else:
        print(f"diloco run: --resume auto: resuming from {root} (newest complete step: {step})", file=sys.stderr,
              flush=True)
        args.resume = root


def _write_json(path: str, doc: Any) -> None:
    """Write ``doc`` as JSON to ``path``, making its folder if missing (as --save and --run-dir do)."""
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def _cmd_run(args: argparse.Namespace) -> int:
    from diloco.runtime.launch import preflight, run_lock

    # before anything imports torch (seconds on a CUDA host): a wrong flag, path or port is refused at once
    if args.resume == "auto":
        _resume_auto(args)
    cfg, point = _config(args)
    preflight.check_run_paths(cfg, run_dir=args.run_dir, json_path=args.json)
    if args.stop_timeout is not None and args.stop_timeout <= 0:
        raise config_mod.ConfigError(f"--stop-timeout must be > 0 seconds, got {args.stop_timeout}")
    # one run per run folder and checkpoint folder: held (open) until this process exits
    checkpoints = cfg.train.checkpoint_dir or (os.path.join(args.run_dir, "checkpoints") if args.run_dir else "")
    made = [f for f in (args.run_dir, checkpoints) if f and not os.path.exists(f)]  # removed again on an early error
    locks = []
    try:
        if args.run_dir:
            locks.append(run_lock.hold("--run-dir", args.run_dir))
        if checkpoints and (not args.run_dir or os.path.realpath(checkpoints) != os.path.realpath(args.run_dir)):
            # the folder the run will write its checkpoints to (launcher.run's default: RUN_DIR/checkpoints), so
            # that another run's --checkpoint-dir or --resume cannot write into it while this one runs
            locks.append(run_lock.hold("--checkpoint-dir", checkpoints))
        return _run_locked(args, cfg, point)
    finally:
        for lock in locks:
            lock.close()
        run_lock.remove_if_unused(made)


def _run_locked(args: argparse.Namespace, cfg: config_mod.Config, point: Any) -> int:
    """``diloco run`` once its folders are locked."""
    from diloco.runtime.launch import launcher
    from diloco.runtime.launch import summary as summary_mod

    logs.setup(cfg.train.log_format, component="run")
    progress = not args.no_progress and cfg.train.log_format == "text"  # a bar is no log line
    # ranks per group the user did not name (flag or --config key) may be cut to the host's GPUs
    named = config_parse.explicit_settings(args).keys() & {("topology", "ranks_per_group"), ("topology", "group_sizes")}
    try:
        summary = launcher.run(cfg, run_dir=args.run_dir, progress=progress, timeout_s=args.run_timeout,
                               resume=point, fit_ranks=point is None and not named, stop_timeout_s=args.stop_timeout)
    except launcher.LaunchError as e:
        print(f"diloco run: error: {e}", file=sys.stderr)
        return e.code
    print(summary_mod.format_summary(summary))
    if args.json:
        _write_json(args.json, summary)
    if summary.get("interrupted"):  # stopped with a checkpoint before the job finished
        print(f"diloco run: {summary['interrupted']}: stopped at step {summary['stopped_at_step']} with a "
              f"checkpoint; exit {exit_codes.describe(exit_codes.INTERRUPTED)}", file=sys.stderr, flush=True)
        return exit_codes.INTERRUPTED
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    # torch-free until the paths are checked: a wrong one is refused at once, even on a CUDA host
    from diloco.runtime.checkpoints import checkpoint_index
    from diloco.runtime.launch import preflight

    auto = args.resume == "auto"
    if auto:  # the newest step of --checkpoint-dir this group completed, if any: used unless the group heals
        from pathlib import Path

        checkpoint_dir = config_parse.from_args(args).train.checkpoint_dir
        if not checkpoint_dir:
            raise config_mod.ConfigError("--resume auto needs --checkpoint-dir (where this group's checkpoints are)")
        root = Path(checkpoint_dir)
        done = root.is_dir() and any(root.glob(f"step-*/{checkpoint_index.manifest_file(args.group_id)}"))
        args.resume = str(root) if done else None
    cfg, point = _config(args, group=args.group_id)
    rank = int(os.environ.get("RANK", "0"))
    preflight.check_worker_paths(cfg, group=args.group_id, rank=rank,
                                 local_rank=int(os.environ.get("LOCAL_RANK", rank)), json_path=args.json)
    from diloco.runtime.rank import worker

    # a folder of steps: the job resumes from the newest any group completed (those behind heal); a step folder:
    # that step, which every group must name
    resume = None if point is None else point.path if checkpoint_index.names_step(args.resume) else point.root
    return worker.main(cfg, args.group_id, args.coordinator, json_path=args.json, resume=resume)


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from diloco.coordinator import CoordinatorServer
    from diloco.coordinator import metrics as coordinator_metrics
    from diloco.coordinator.finish import FINISH_GRACE_S, report_job, wait_for_job

    logs.setup(args.log_format, component="coordinator")
    tls_files = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls_files) and not all(tls_files):
        raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
    from transport.tls import TlsConfig

    server = CoordinatorServer(
        host=args.host, port=args.port, expected_groups=args.groups,
        token=os.environ.get("DILOCO_TOKEN") or None, join_timeout_s=args.join_timeout,
        tls=TlsConfig(*tls_files) if all(tls_files) else None, allow_insecure=args.insecure_coordinator,
        heartbeat_timeout_s=args.heartbeat_timeout, min_groups=args.min_groups, outlier_factor=args.outlier_factor,
        quorum_grace_s=args.quorum_grace, checkpoint_hint=args.checkpoint_hint,
        restart_when_state_lost=True,  # every group lost: exit 75, the groups resume from their checkpoints
    )
    from diloco.coordinator import CoordinatorError

    try:  # a port in use or an address not here is a setting (exit 2), not a crash a restart mends
        address = server.start()
    except CoordinatorError as e:
        raise config_mod.ConfigError(f"--host/--port: {e}") from None
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    finished = False
    http = None
    try:  # from the first line a user sees, Ctrl-C ends it as below
        print(f"diloco coordinator listening on {address} for {args.groups} groups", flush=True)
        if args.metrics_port:
            try:
                http = coordinator_metrics.serve(server, host=args.host, port=args.metrics_port,
                                                 token=os.environ.get("DILOCO_TOKEN") or None,
                                                 certificates=server.tls_certificates)
            except OSError as e:  # the finally below stops the server
                raise config_mod.ConfigError(f"--metrics-port {args.metrics_port} on {args.host}: {e}") from None
            print(f"diloco coordinator metrics and status on http://{args.host}:{http.port} "
                  "(/metrics, /status, /healthz)", flush=True)
        summaries = wait_for_job(server, stop)
        if summaries is not None:
            finished = True
            code = report_job(summaries, args.json, joined_late=server.joined_late)
            if args.keep_running:
                stop.wait()
        elif server.halted:  # the groups were told (exit 2 each): serve their last calls, then stop
            print(f"diloco coordinator: the job halted: {server.halted}; exit "
                  f"{exit_codes.describe(exit_codes.CONFIGURATION)}", file=sys.stderr, flush=True)
            code = exit_codes.CONFIGURATION
        elif signals:  # stopped before the job finished: a deleted or evicted pod, a drain
            code = exit_codes.for_signal(signals[0])
            print(f"diloco coordinator: {signal.Signals(signals[0]).name} before the job finished; exit "
                  f"{exit_codes.describe(code)}: restart it and the groups rejoin", file=sys.stderr, flush=True)
        elif server.state_lost:
            print(f"diloco coordinator: {server.state_lost}; exit {exit_codes.describe(exit_codes.RESTART)}",
                  file=sys.stderr, flush=True)
            code = exit_codes.RESTART
    except KeyboardInterrupt:  # Ctrl-C is how a foreground coordinator is stopped
        if not finished:
            code = exit_codes.INTERRUPTED
            print(f"diloco coordinator: Ctrl-C before the job finished; exit {exit_codes.describe(code)}",
                  file=sys.stderr, flush=True)
    finally:  # calls in flight (the last summary's Ack) get up to FINISH_GRACE_S to finish
        server.stop(grace_s=FINISH_GRACE_S)
        if http is not None:
            http.close()
    return code


def _cmd_status(args: argparse.Namespace) -> int:
    from diloco.runtime.ops import status

    return status.main(args.address, as_json=args.json, timeout_s=args.timeout, token_file=args.token_file)


def _cmd_credentials(args: argparse.Namespace) -> int:
    """``diloco credentials``: every group's own credentials as files (see its --help). Torch-free."""
    from pathlib import Path

    from diloco.runtime.rank import endpoint

    token = os.environ.get(endpoint.TOKEN_ENV, "")
    if not token:
        raise config_mod.ConfigError(f"set {endpoint.TOKEN_ENV} to the job token (the coordinator's)")
    if not os.environ.get(endpoint.SECRET_ENV):
        raise config_mod.ConfigError(f"set {endpoint.SECRET_ENV} to the job's data-plane secret (hex, 32+ digits)")
    try:
        secret = endpoint.read_secret()
    except endpoint.ConnectError as e:
        raise config_mod.ConfigError(f"{endpoint.SECRET_ENV}: {e}") from None
    if not isinstance(secret, bytes):
        raise config_mod.ConfigError(f"{endpoint.SECRET_ENV} holds one group's keyring, not the job's "
                                     "data-plane secret")
    if args.groups < 1:
        raise config_mod.ConfigError(f"--groups must be >= 1, got {args.groups}")
    out = Path(args.out)
    folders = [out / f"group-{g}" for g in range(args.groups)]
    taken = [str(f / name) for f in folders for name in endpoint.CREDENTIAL_FILES.values() if (f / name).exists()]
    if taken:
        raise config_mod.ConfigError(f"not overwriting existing credentials: {', '.join(taken)}")
    minted = [endpoint.group_credentials(token, secret, g, args.groups) for g in range(args.groups)]  # checks first
    out.mkdir(parents=True, exist_ok=True)
    for folder, own in zip(folders, minted):
        folder.mkdir(mode=0o700, exist_ok=True)
        folder.chmod(0o700)
        for var, value in own.items():
            endpoint.write_secret_file(folder / endpoint.CREDENTIAL_FILES[var], value)
        print(f"{folder.name}: {folder}/ ({', '.join(endpoint.CREDENTIAL_FILES.values())})")
    print(f"each group's ranks get only their own folder, e.g. kubectl -n diloco create secret generic "
          f"diloco-credentials-G --from-file={out}/group-G; the job token goes only to the coordinator")
    return 0


def _die_with_agent() -> None:
    """A worker under torchrun ends with its agent (parent-death signal), asked for before torch
    loads (seconds during which a killed agent would otherwise leave the worker running)."""
    from diloco.runtime.launch import agent

    parent = os.environ.get(agent.PARENT_ENV)
    if parent is not None:
        agent.die_with_parent(int(parent))
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # a plain torchrun: its agent is the parent now
        agent.die_with_parent()


def _stop_during_start_up(command: str) -> None:
    """SIGTERM before ``command`` installs its own handler (a pod deleted while it starts): ``run``
    stops as on Ctrl-C (its own cleanup, exit 130); the others exit 75 (restart me) at once, as
    nothing is trained or served yet. Without a handler, SIGTERM to a container's PID 1 is dropped
    and the pod ends in the kubelet's SIGKILL (137), which its Job counts."""

    def handler(signum: int, frame: Any) -> None:
        if command == "run":
            raise KeyboardInterrupt
        print(f"diloco {command}: {signal.Signals(signum).name} while starting; exit "
              f"{exit_codes.describe(exit_codes.for_signal(signum))}", file=sys.stderr, flush=True)
        os._exit(exit_codes.for_signal(signum))

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """``diloco COMMAND ...``; returns the exit code (diloco.runtime.ops.exit_codes). Called in a
    process of its own, or in-process (tests, scripts): the SIGTERM handler it had is put back."""
    argv = sys.argv[1:] if argv is None else argv
    in_main_thread = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    try:
        if argv[:1] and argv[0] not in ("status", "credentials", "-h", "--help"):
            _stop_during_start_up(argv[0])
        return _main(argv)
    finally:
        if in_main_thread and before is not None:
            signal.signal(signal.SIGTERM, before)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["torchrun"]:  # torchrun's own arguments, which argparse here would not pass through
        from diloco.runtime.launch import agent

        return agent.main(argv[1:])
    # diloco run's warm spare (runtime/launch/spare.py), not a user's command
    if argv[:1] == ["spare"] and len(argv) <= 2:
        from diloco.runtime.launch import spare

        return spare.serve(lambda args: main(["worker", *args]), argv[1] if len(argv) == 2 else None)
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        _die_with_agent()
    if args.command not in ("status", "credentials"):
        stack_dumps.install()  # kill -USR1: every thread's stack to the log
    handler = {"run": _cmd_run, "worker": _cmd_worker, "coordinator": _cmd_coordinator,
               "status": _cmd_status, "credentials": _cmd_credentials}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("diloco: interrupted; stopped every process it started", file=sys.stderr)
        return exit_codes.INTERRUPTED
    except (config_mod.ConfigError, ValueError, RuntimeError, OSError) as e:
        print(f"diloco {args.command}: error: {e}", file=sys.stderr)
        return exit_codes.CONFIGURATION if isinstance(e, ValueError) else exit_codes.OTHER
    finally:  # the command's logging setup (logs.setup) ends with it
        logs.teardown()


if __name__ == "__main__":
    sys.exit(main())
