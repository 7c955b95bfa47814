"""The ``diloco`` command's arguments: one sub-command each for ``run``, ``worker``,
``coordinator``, ``status`` and ``credentials`` (``diloco.cli`` runs them); the job's options
come from the config's fields (``diloco.job.config_parse``), grouped by section with the everyday
ones first."""

from __future__ import annotations

import argparse

from diloco.job import config as config_mod
from diloco.job import config_parse

DESCRIPTION = """\
Low-bandwidth local-update training (DiLoCo) across worker groups.

  diloco run           coordinator + groups on this machine (the embedded default)
  diloco coordinator   the membership service alone (one per job, e.g. on Kubernetes)
  diloco worker        one rank of one group; start it under torchrun
  diloco torchrun      torchrun (its own arguments) whose exit code says why the group stopped
  diloco status        ask a running coordinator (its --metrics-port) how the job is doing
  diloco credentials   write each group's own credentials, from the job's token and secret

Exit codes: 0 done, 1 error, 2 configuration error (nothing was started, or a restart would
repeat it), 75 restart me (a fault: the group heals when restarted), 130 interrupted.
"""


QUORUM_HELP = """\
fault tolerance: every exchange between groups runs among a quorum of the groups alive then. A
group silent for --heartbeat-timeout seconds (or restarted) is left out of the next quorum and the
others go on (with --quorum-grace S: once S seconds passed after the first group asked); a round is applied only if every rank of every member finished it, otherwise no one
applies it and it is retried; a restarted group heals (fetches the job's state from a live member)
and rejoins. The mean is weighted by the tokens each group trained. NaN/Inf or outlier
pseudo-gradients (--outlier-factor) are refused. If every group is lost at once, diloco run says
"job lost" and exits 75: resume from the job checkpoints. See docs/fault_tolerance.md.
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
        "loopback, train the demo GPT (or your own model: --entry package.module:function), and print a summary. "
        "Groups that fail are started again (--max-restarts) and heal; --chaos N kills N random groups "
        "during the run as a drill (--chaos-kinds: also stalls, and bits flipped on a group's links). With GPUs "
        "(backend nccl) every rank of a group gets its own GPU and the groups are spread over the host's GPUs "
        "before any GPU is shared between groups; where a group has more ranks than the host has GPUs, the default --ranks-per-group is cut to the GPU count (the "
        "summary's placement line says so) and an explicit --ranks-per-group or --group-sizes stops with an "
        "error before any process starts (groups under torchrun by hand: DILOCO_GPU_OFFSET, see diloco "
        "worker --help).",
        epilog=QUORUM_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    everyday = run.add_argument_group(config_parse.EVERYDAY_TITLE, config_parse.EVERYDAY_DESCRIPTION)
    own = run.add_argument_group("diloco run", "this command's own settings (not the job's: no [section] key)")
    config_parse.add_arguments(run, everyday)  # the job's everyday options, then a group per config section
    everyday.add_argument("--run-dir", metavar="DIR", default=None,
                          help="folder for logs and the resolved config; one diloco run at a time may use it (a lock "
                          "file in it; a second run exits 2 naming the first's pid) [default: a new temp folder]")
    everyday.add_argument("--resume", metavar="DIR", default=None,
                          help="continue the job of a checkpoint folder (--checkpoint-dir; the newest step every group "
                          "completed) or of one step-N folder in it; the config is the checkpoint's, and flags may "
                          "only change settings that do not change the math (paths, logging, checkpoints, addresses). "
                          "auto: from the newest complete step in --checkpoint-dir (else RUN_DIR/checkpoints) if "
                          "there is one, else a fresh start; it says which [default: none]")
    own.add_argument("--json", metavar="PATH", default=None,
                     help="also write the summary as JSON to PATH (its folder is made if missing) [default: none]")
    own.add_argument("--no-progress", action="store_true", help="no progress bar [default: show it]")
    own.add_argument("--run-timeout", type=float, default=None, metavar="SECONDS",
                     help="stop everything after this long [default: no limit]")
    own.add_argument("--stop-timeout", type=float, default=None, metavar="SECONDS",
                     help="after a first Ctrl-C or SIGTERM every group checkpoints at its next exchange and stops; "
                     "past this deadline (or at a second signal) every process is stopped at once [default: three "
                     "rounds at the pace so far, between 30 and 300 s]")

    worker = sub.add_parser(
        "worker", help="one rank of one worker group (run under torchrun)",
        description="Run under torchrun, one job per group: torchrun --nproc-per-node R --max-restarts N -m diloco "
        "worker --coordinator HOST:PORT --group-id G [options] (diloco torchrun, with the same arguments, keeps the "
        "workers' exit codes). Needs DILOCO_SECRET (hex) in the environment. Exits 0 when done, 75 after a "
        "fault (the coordinator took the group out, a peer or the coordinator was lost: restart it and it "
        "heals), 2 for a configuration error (a restart would repeat it), 1 for anything else. A rank that "
        "waits (for the coordinator, a quorum, a donor, the other groups' data) says so every 10 s. With NCCL, local rank i "
        "uses GPU i + $DILOCO_GPU_OFFSET (default 0): give each group on a shared host its own offset, e.g. 0 "
        "and 4 for two groups of 4 ranks on 8 GPUs ($DILOCO_DEVICE_MAP=\"2,3\", a GPU per local rank, "
        "overrides it; diloco run sets that).",
        epilog=QUORUM_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    everyday = worker.add_argument_group(config_parse.EVERYDAY_TITLE, config_parse.EVERYDAY_DESCRIPTION)
    everyday.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="address of the coordinator")
    everyday.add_argument("--group-id", required=True, type=int, help="this group's id, 0..groups-1")
    own = worker.add_argument_group("diloco worker", "this command's own settings (not the job's: no [section] key)")
    config_parse.add_arguments(worker, everyday)  # the job's everyday options, then a group per config section
    everyday.add_argument("--resume", metavar="DIR", default=None,
                          help="continue from a job checkpoint: a step-N folder, or a folder of them (the newest step "
                          "every group completed, else the newest this group completed); every group must resume "
                          "from the same step. auto: from the newest step in --checkpoint-dir this group completed, "
                          "if any, unless the job is running (the group then heals from a live group): what a "
                          "restarted pod wants [default: none]")
    own.add_argument("--json", metavar="PATH", default=None,
                     help="rank 0 writes the group's summary here as JSON [default: none]")

    sub.add_parser(
        "torchrun", help="torchrun whose exit code says why the workers stopped (0, 2, 75, 1)", add_help=False,
        description="diloco torchrun TORCHRUN-ARGS: exactly torchrun's arguments (diloco torchrun --help shows "
        "them); exits with the workers' own code (diloco.runtime.ops.exit_codes) where torchrun would exit 1.",
    )

    coord = sub.add_parser(
        "coordinator", help="run the membership/quorum service",
        description="Serve the coordinator until every group has ended (trained to the end, or restarted after the "
        "others had finished; a group stopped by its own SIGTERM comes back and is waited for), print the job's "
        "summary and exit: code 0, or 1 if the groups' global parameters diverged (or a group sent no "
        "parameter hash, or reported failure); 75 once every group was lost (restart it and the groups resume), "
        "2 once the job halted (its groups differed with no majority, twice: the message names them). SIGTERM before the job finished "
        "exits 75 (restart me: a deleted or evicted pod is replaced and the groups rejoin), Ctrl-C 130. Reads the token every call must carry from DILOCO_TOKEN. On a non-loopback --host it "
        "refuses to start without both the token and mutual TLS (--tls-cert/--tls-key/--tls-ca, the same "
        "kind of certificates as the workers' data plane), unless --insecure-coordinator is given.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    coord.add_argument("--host", default="127.0.0.1", help="address to listen on")
    coord.add_argument("--port", type=int, default=29400, help="port to listen on (0 = any free port)")
    coord.add_argument("--groups", type=int, default=2, help="groups the job waits for")
    coord.add_argument("--join-timeout", type=float, default=600.0, help="seconds a join waits for the others")
    coord.add_argument("--heartbeat-timeout", type=float, default=15.0,
                       help="seconds of silence from any rank of a group before the group is declared failed and "
                       "left out of the next quorum (workers: the same --heartbeat-timeout)")
    coord.add_argument("--min-groups", type=int, default=1, help="fewest groups an exchange may run with (a control exchange counts the groups healing in)")
    coord.add_argument("--quorum-grace", type=float, default=0.0,
                       help="seconds an exchange waits, after the first group asked for it, for the other live "
                       "groups; then it runs with those that asked and a group left out heals (0 = off: wait for "
                       "every live group until the heartbeat timeout)")
    coord.add_argument("--checkpoint-hint", default="",
                       help="where the groups' job checkpoints are, named when every group is lost at once "
                       "('job lost: every group failed; resume from checkpoint (HINT)')")
    coord.add_argument("--outlier-factor", type=float, default=10.0,
                       help="refuse a pseudo-gradient whose norm exceeds this multiple of its group's recent median "
                       "(0: only NaN/Inf)")
    coord.add_argument("--keep-running", action="store_true",
                       help="once every group has ended, print the job summary but keep serving until "
                       "SIGTERM or Ctrl-C (the exit code is then still 0 or 1 as above); off: exit at once")
    coord.add_argument("--json", metavar="PATH", default=None,
                       help="also write the job summary as JSON to PATH once every group has ended")
    coord.add_argument("--metrics-port", type=int, default=0,
                       help="serve Prometheus /metrics, the /status document (diloco status) and /healthz over "
                       "HTTP on this port of --host (0 = off)")
    coord.add_argument("--log-format", choices=config_mod.LOG_FORMATS, default="text",
                       help="log lines: text for people, json (one object per line) for collectors")
    coord.add_argument("--tls-cert", metavar="PEM", default=None,
                       help="this coordinator's certificate; with --tls-key and --tls-ca it serves mutual TLS "
                       "(it must name the host workers dial; workers use their own --tls-* files)")
    coord.add_argument("--tls-key", metavar="PEM", default=None, help="this coordinator's private key")
    coord.add_argument("--tls-ca", metavar="PEM", default=None,
                       help="CA certificate that must have signed every client's certificate")
    coord.add_argument("--insecure-coordinator", action="store_true",
                       help="serve on a non-loopback --host without TLS or without DILOCO_TOKEN: anyone who "
                       "reaches the port can join as a group, vote on rounds and rewrite the bandwidth table")

    status = sub.add_parser(
        "status", help="show a running job: membership, rounds, progress, bandwidth, ring order",
        description="Read the /status document a coordinator serves on its --metrics-port (diloco run: "
        "--metrics-port + the number of ranks) and print it. The document names every member's address: a "
        "coordinator with a token answers only the job token, from --token-file or $DILOCO_TOKEN (diloco run "
        "always has one, in RUN_DIR/coordinator-token while it runs; its log names the file).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    status.add_argument("--address", default="127.0.0.1:9400", metavar="HOST:PORT",
                        help="the coordinator's metrics address (or an http:// URL)")
    status.add_argument("--token-file", metavar="PATH", default=None,
                        help="file holding the job token (diloco run: RUN_DIR/coordinator-token) [default: "
                        "$DILOCO_TOKEN]")
    status.add_argument("--json", action="store_true", help="print the status document as JSON")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")

    creds = sub.add_parser(
        "credentials", help="write each group's own credentials (one Secret per group) from the job's",
        description="Read the job token ($DILOCO_TOKEN, the coordinator's) and the data-plane secret "
        "($DILOCO_SECRET, hex) and write, for each group G of --groups, OUT/group-G/data-plane-keys (its "
        "pair key with every group: DILOCO_SECRET for its ranks) and OUT/group-G/coordinator-credential "
        "(DILOCO_TOKEN for its ranks), files of mode 0600 in folders of mode 0700. A group's ranks given only "
        "these can prove they are group G and nobody else: they cannot act for another group, stop the job "
        "or read /status, and the job token and secret stay with the operator and the coordinator. One "
        "Kubernetes Secret per group: kubectl create secret generic diloco-credentials-G --from-file=OUT/group-G "
        "(deploy/README.md). Existing files are not overwritten.",
    )
    creds.add_argument("--groups", type=int, required=True, help="the job's number of groups ([topology] groups)")
    creds.add_argument("--out", metavar="DIR", required=True, help="folder to write group-0/, group-1/, ... into")
    return parser
