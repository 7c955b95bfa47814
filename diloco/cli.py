"""The ``diloco`` command: ``run`` (embedded default), ``worker`` (under torchrun), ``coordinator``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from diloco import config as config_mod

DESCRIPTION = """\
Low-bandwidth local-update training (DiLoCo) across worker groups.

  diloco run           coordinator + groups on this machine (the embedded default)
  diloco coordinator   the membership service alone (one per job, e.g. on Kubernetes)
  diloco worker        one rank of one group; start it under torchrun
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser(
        "run", help="train on this machine: a coordinator and several groups on loopback",
        description="Start a coordinator and --groups torchrun jobs of --ranks-per-group ranks on "
        "loopback, train the demo GPT (or your own model: --entry package.module:function), and print a summary.",
    )
    run.add_argument("--json", metavar="PATH", default=None, help="also write the summary as JSON to PATH [default: none]")
    run.add_argument("--run-dir", metavar="DIR", default=None, help="folder for logs and the resolved config [default: a new temp folder]")
    run.add_argument("--no-progress", action="store_true", help="no progress bar [default: show it]")
    run.add_argument("--run-timeout", type=float, default=None, metavar="SECONDS", help="stop everything after this long [default: no limit]")
    config_mod.add_arguments(run)

    worker = sub.add_parser(
        "worker", help="one rank of one worker group (run under torchrun)",
        description="Run under torchrun, one job per group: torchrun --nproc-per-node R -m diloco worker "
        "--coordinator HOST:PORT --group-id G [options]. Needs DILOCO_SECRET (hex) in the environment.",
    )
    worker.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="address of the coordinator")
    worker.add_argument("--group-id", required=True, type=int, help="this group's id, 0..groups-1")
    worker.add_argument("--json", metavar="PATH", default=None, help="rank 0 writes the group's summary here as JSON [default: none]")
    config_mod.add_arguments(worker)

    coord = sub.add_parser(
        "coordinator", help="run the membership/quorum service",
        description="Serve the coordinator until every group has reported its summary, print the job's "
        "summary and exit: code 0, or 1 if the groups' global parameters diverged (or a group sent no "
        "parameter hash, or reported failure). SIGTERM or Ctrl-C stop it earlier, printing nothing, with "
        "code 0. Reads an optional token from DILOCO_TOKEN.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    coord.add_argument("--host", default="127.0.0.1", help="address to listen on")
    coord.add_argument("--port", type=int, default=29400, help="port to listen on (0 = any free port)")
    coord.add_argument("--groups", type=int, default=2, help="groups the job waits for")
    coord.add_argument("--join-timeout", type=float, default=600.0, help="seconds a join waits for the others")
    coord.add_argument("--keep-running", action="store_true",
                       help="once every group has reported, print the job summary but keep serving until "
                       "SIGTERM or Ctrl-C (the exit code is then still 0 or 1 as above); off: exit at once")
    coord.add_argument("--json", metavar="PATH", default=None,
                       help="also write the job summary as JSON to PATH once every group has reported")
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from diloco import launcher

    cfg = config_mod.from_args(args)
    summary = launcher.run(cfg, run_dir=args.run_dir, progress=not args.no_progress, timeout_s=args.run_timeout)
    print(launcher.format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from diloco import worker

    return worker.main(config_mod.from_args(args), args.group_id, args.coordinator, json_path=args.json)


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from diloco.coordinator import CoordinatorServer
    from diloco.coordinator.finish import FINISH_GRACE_S, report_job, wait_for_job

    server = CoordinatorServer(
        host=args.host, port=args.port, expected_groups=args.groups,
        token=os.environ.get("DILOCO_TOKEN") or None, join_timeout_s=args.join_timeout,
    )
    address = server.start()
    print(f"diloco coordinator listening on {address} for {args.groups} groups", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    code = 0
    try:
        summaries = wait_for_job(server, stop)
        if summaries is not None:
            code = report_job(summaries, args.json)
            if args.keep_running:
                stop.wait()
    except KeyboardInterrupt:  # Ctrl-C is how a foreground coordinator is stopped
        pass
    finally:  # calls in flight (the last summary's Ack) get up to FINISH_GRACE_S to finish
        server.stop(grace_s=FINISH_GRACE_S)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"run": _cmd_run, "worker": _cmd_worker, "coordinator": _cmd_coordinator}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("diloco: interrupted; stopped every process it started", file=sys.stderr)
        return 130
    except (config_mod.ConfigError, ValueError, RuntimeError, OSError) as e:
        print(f"diloco {args.command}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
