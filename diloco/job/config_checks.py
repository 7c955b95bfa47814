"""The checks of a ``Config``, one small named function per section or cross-section rule.

Each takes the whole config and returns its problems (one sentence each, naming the flag);
``problems`` runs them in the order a user reads ``diloco run --help``'s sections in and
``Config.validate`` raises one ``ConfigError`` listing all of them. A codec's, an outer rule's
and a schedule's own rules live in their specs (``CodecSpec.problems``, ``OuterSpec.problems``,
``ScheduleSpec.problems``); what is here combines a spec with the rest of the job.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.codec_spec import codec_names
from diloco.engine.modes import MAX_FRAGMENTS, MODES, in_words, modes_where
from diloco.job.auto_choice import AUTO, AUTO_H, auto_problems

#: a ``diloco.job.config.Config`` (not imported: that module imports this one)
Config = Any

Need = Callable[[bool, str], None]


def _collect(check: Callable[[Config, Need], None]) -> Callable[[Config], list[str]]:
    """A check written as calls of ``need(condition, message)`` as one that returns the messages
    of the conditions that failed."""
    def run(cfg: Config) -> list[str]:
        found: list[str] = []
        check(cfg, lambda ok, msg: None if ok else found.append(msg))
        return found
    run.__name__, run.__doc__ = check.__name__, check.__doc__
    return run


def field_problems(cfg: Config) -> list[str]:
    """Every option against its own choices, and every float option finite."""
    found = []
    for section in dataclasses.fields(cfg):
        options = getattr(cfg, section.name)
        for f in dataclasses.fields(options):
            value, flag, choices = getattr(options, f.name), f.metadata["flag"], f.metadata.get("choices")
            if choices and value not in choices:
                found.append(f"{flag}: {value!r} is not one of {', '.join(choices)}")
            if isinstance(value, float) and not math.isfinite(value):
                found.append(f"{flag}: must be finite, got {value}")
    return found


@_collect
def guard_problems(cfg: Config, need: Need) -> None:
    """The data plane's limits on unauthenticated peers and pending bytes."""
    tr = cfg.transport
    need(tr.handshake_timeout > 0, f"--handshake-timeout must be > 0 seconds, got {tr.handshake_timeout}")
    need(tr.max_unauthenticated >= 1 and tr.max_unauthenticated_per_source >= 1,
         "--max-unauthenticated and --max-unauthenticated-per-source must be >= 1")
    need(tr.max_pending_bytes >= 0, f"--max-pending-bytes must be >= 0, got {tr.max_pending_bytes}")


@_collect
def fault_problems(cfg: Config, need: Need) -> None:
    """Heartbeats, quorums, restarts, spares and the fault drill."""
    fl, t = cfg.fault, cfg.topology
    need(fl.heartbeat_timeout > 0, f"--heartbeat-timeout must be > 0 seconds, got {fl.heartbeat_timeout}")
    need(1 <= fl.min_groups <= t.groups, f"--min-groups must be in [1, --groups={t.groups}], got {fl.min_groups}")
    need(fl.outlier_factor >= 0, f"--outlier-factor must be >= 0 (0 = off), got {fl.outlier_factor}")
    need(fl.quorum_grace >= 0, f"--quorum-grace must be >= 0 seconds (0 = off), got {fl.quorum_grace}")
    need(fl.max_restarts >= 0 and fl.chaos >= 0 and fl.spares >= 0, "--max-restarts, --chaos and --spares must be >= 0")
    need(fl.spares == 0 or max(t.sizes()) == 1,
         f"--spares replace groups of one rank (a spare runs the group's only rank); groups have {t.sizes()}")
    need(fl.chaos == 0 or fl.max_restarts >= 1, "--chaos needs --max-restarts >= 1 (killed groups are restarted)")
    kinds = fl.kinds_problem()
    need(kinds is None, kinds or "")


@_collect
def model_data_inner_problems(cfg: Config, need: Need) -> None:
    """The demo model's shape, the data split and batches, the inner optimizer."""
    m, d, i = cfg.model, cfg.data, cfg.inner
    need(m.n_layer >= 1, f"--n-layer must be >= 1, got {m.n_layer}")
    need(m.n_head >= 1 and m.n_embd % max(m.n_head, 1) == 0,
         f"--n-embd ({m.n_embd}) must be a positive multiple of --n-head ({m.n_head})")
    need(m.block_size >= 2, f"--block-size must be >= 2, got {m.block_size}")
    need(0.0 <= m.dropout < 1.0, f"--dropout must be in [0, 1), got {m.dropout}")
    need(0.0 < d.val_fraction < 1.0, f"--val-fraction must be in (0, 1), got {d.val_fraction}")
    need(d.batch_size >= 1, f"--batch-size must be >= 1, got {d.batch_size}")
    need(d.eval_batches >= 1, f"--eval-batches must be >= 1, got {d.eval_batches}")
    need(i.lr > 0, f"--inner-lr must be > 0, got {i.lr}")
    need(i.weight_decay >= 0, f"--weight-decay must be >= 0, got {i.weight_decay}")
    need(i.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {i.warmup_steps}")
    need(0.0 <= i.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {i.min_lr_ratio}")
    need(i.grad_clip >= 0, f"--grad-clip must be >= 0, got {i.grad_clip}")


def outer_problems(cfg: Config) -> list[str]:
    """The outer rule's own checks, in the sync mode it runs under."""
    return cfg.outer.spec().problems(cfg.sync.mode)


@_collect
def sync_problems(cfg: Config, need: Need) -> None:
    """H, the schedule, fragments, overlap and rounds by time, against the steps and the model."""
    m, s, train = cfg.model, cfg.sync, cfg.train
    h_auto = s.h == AUTO_H
    need(h_auto or (isinstance(s.h, int) and not isinstance(s.h, bool) and s.h >= 1),
         f"--h must be >= 1 (inner steps per sync) or auto, got {s.h!r}")
    h_set = not h_auto and isinstance(s.h, int)  # the checks of H below: auto's run on the setting it decides
    schedule = cfg.schedule_spec()
    for problem in schedule.problems():
        need(False, problem)
    paced = s.schedule == "paced" and h_set
    shortest = None
    if paced and s.h >= 1 and math.isfinite(s.paced_gamma) and not schedule.problems():
        shortest = schedule.shortest_paced_period()
    need(1 <= s.fragments <= MAX_FRAGMENTS, f"--fragments must be in [1, {MAX_FRAGMENTS}], got {s.fragments}")
    if not train.entry:  # the demo GPT's fragments are its blocks
        need(m.n_layer >= s.fragments, f"--fragments ({s.fragments}) cannot exceed --n-layer ({m.n_layer})")
        need(not train.entry_args, "--entry-args needs --entry (the demo takes no entry arguments)")
    else:
        need(":" in train.entry, f"--entry must look like package.module:function, got {train.entry!r}")
    need(not h_set or s.h >= s.fragments, f"--h ({s.h}) must be >= --fragments ({s.fragments})")
    need(s.overlap_steps >= 0, f"--overlap-steps must be >= 0, got {s.overlap_steps}")
    need(s.round_seconds >= 0, f"--round-seconds must be >= 0 (0 = rounds of H steps), got {s.round_seconds}")
    if s.round_seconds > 0:
        timed = modes_where("time_rounds")
        need(s.mode in timed and s.schedule == "fixed",
             f"--round-seconds runs with --mode {in_words(timed)} (any --fragments) and --schedule fixed "
             f"({', '.join(m for m in MODES if m not in timed)} and QSR are not supported with rounds by "
             f"time), not --mode {s.mode} --schedule {s.schedule}")
        need(not (train.checkpoint_every or train.stop_after),
             "--round-seconds does not take --checkpoint-every or --stop-after yet: job checkpoints are taken "
             "at an inner step every group reaches together, and with rounds by time groups run at their own step")
    if s.mode in modes_where("takes_tau") and h_set:
        # the engine staggers the fragments over the first round, which the run's steps cap
        first = s.h if s.round_seconds > 0 else min(s.h, max(train.steps, 1))
        need(s.overlap_steps < first // s.fragments,
             f"--overlap-steps ({s.overlap_steps}) must be < H/P ({first // max(s.fragments, 1)})"
             + (f", with H capped at {first} by --steps" if first < s.h else ""))
        if paced and shortest:
            need(s.overlap_steps < shortest // s.fragments,
                 f"--overlap-steps ({s.overlap_steps}) must be < the shortest paced period / P "
                 f"({shortest // max(s.fragments, 1)})")


@_collect
def topology_problems(cfg: Config, need: Need) -> None:
    """Groups, their sizes, threads and how a group is parallel inside."""
    t = cfg.topology
    need(1 <= t.groups <= 64, f"--groups must be in [1, 64], got {t.groups}")
    need(1 <= t.ranks_per_group <= 64, f"--ranks-per-group must be in [1, 64], got {t.ranks_per_group}")
    if t.group_sizes:
        try:
            sizes = t.sizes()
            need(len(sizes) == t.groups and all(1 <= n <= 64 for n in sizes),
                 f"--group-sizes needs {t.groups} sizes in [1, 64], got {t.group_sizes!r}")
        except ValueError:
            need(False, f"--group-sizes must be comma-separated integers, got {t.group_sizes!r}")
    need(t.threads_per_rank >= 0, f"--threads-per-rank must be >= 0 (0: the CPU request's share), got {t.threads_per_rank}")
    need(t.parallel != "fsdp" or cfg.sync.mode != "dp",
         "--parallel fsdp does not combine with --mode dp (the data-parallel baseline averages whole gradients)")


@_collect
def train_problems(cfg: Config, need: Need) -> None:
    """Steps, logging, metrics and job checkpoints."""
    tc = cfg.train
    need(tc.steps >= 1, f"--steps must be >= 1, got {tc.steps}")
    need(0 <= tc.metrics_port <= 65535 - 64 * 64, f"--metrics-port out of range: {tc.metrics_port}")
    need(tc.log_every >= 1, f"--log-every must be >= 1, got {tc.log_every}")
    need(tc.progress_every >= 0, f"--progress-every must be >= 0 s, got {tc.progress_every}")
    need(tc.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {tc.checkpoint_every}")
    need(0 <= tc.stop_grace < 3600, f"--stop-grace must be in [0, 3600) seconds, got {tc.stop_grace}")
    need(tc.checkpoint_keep == 0 or tc.checkpoint_keep >= 2,
         f"--checkpoint-keep must be 0 (all) or >= 2 (the newest complete one survives a crash mid-write), "
         f"got {tc.checkpoint_keep}")
    need(0 <= tc.stop_after < tc.steps, f"--stop-after must be in [0, --steps ({tc.steps})), got {tc.stop_after}")


@_collect
def codec_problems(cfg: Config, need: Need) -> None:
    """The codec's own checks (``CodecSpec.problems``) and the rules it shares with the outer rule and mode."""
    o, s, tr = cfg.outer, cfg.sync, cfg.transport
    spec = tr.codec_spec()
    own = spec.problems()
    for problem in own:
        need(False, problem)
    if own:
        return
    feedback = spec.error_feedback
    ef_codecs = ", ".join(codec_names(error_feedback=True))
    need(not feedback or s.mode in modes_where("error_feedback"),
         f"--codec {tr.codec} needs error feedback, which --mode {s.mode} does not keep "
         f"(use {in_words(modes_where('error_feedback'))}, or a codec of 4 bits or more)")
    need(o.residual_decay == 1.0 or feedback,
         f"--residual-decay applies to codecs with error feedback ({ef_codecs}), not {tr.codec}"
         + (" (auto chooses the codec)" if tr.codec == AUTO else ""))
    if o.optimizer == "sparseloco":
        need(feedback, f"--outer-optimizer sparseloco needs a codec with error feedback ({ef_codecs}), not "
                       f"{tr.codec}: its residual stands in for outer momentum")
        chunk = spec.params().get("chunk", 4096) if feedback else 4096
        need(chunk == 4096, f"--outer-optimizer sparseloco takes top-k per 64x64 tile: --codec-block must be 4096 "
                            f"(or 0), got {chunk}")
        need(tr.chunk_bytes % (4 * 4096) == 0,
             f"--outer-optimizer sparseloco: --chunk-bytes must be a multiple of 16384 (whole tiles per frame), "
             f"got {tr.chunk_bytes}")
        need(cfg.topology.parallel != "fsdp",
             "--outer-optimizer sparseloco takes top-k per 64x64 tile of each whole tensor, which a sharded "
             "group (--parallel fsdp) does not hold: use --parallel ddp, or from the Python API "
             "diloco.sparseloco(tile=None) (top-k over chunks of each rank's flat shard)")
    if tr.final_codec:
        need(tr.codec != AUTO and s.h != AUTO_H,
             "--final-codec with --codec auto or --h auto: auto chooses the codecs")
        need(o.optimizer != "sparseloco", "--final-codec: SparseLoCo's rule keeps its residuals to the end")
        need(s.mode in modes_where("final_codec"), f"--final-codec applies to modes with an outer step on a mean "
             f"of pseudo-gradients ({', '.join(modes_where('final_codec'))}), not {s.mode}")


@_collect
def transport_problems(cfg: Config, need: Need) -> None:
    """Streams, frames, probes, plans, TLS files, deadlines and the addresses a rank listens on and gives."""
    tr = cfg.transport
    need(1 <= tr.connections <= 64, f"--connections must be in [1, 64], got {tr.connections}")
    need(4096 <= tr.chunk_bytes <= 256 << 20, f"--chunk-bytes must be in [4096, 256 MiB], got {tr.chunk_bytes}")
    need(tr.probe_bytes >= 0, f"--probe-bytes must be >= 0, got {tr.probe_bytes}")
    need(tr.reprobe_every >= 0, f"--reprobe-every must be >= 0, got {tr.reprobe_every}")
    need(tr.plan_every >= 1, f"--plan-every must be >= 1, got {tr.plan_every}")
    need(tr.stripes_per_rank >= 1, f"--stripes-per-rank must be >= 1, got {tr.stripes_per_rank}")
    tls = [tr.tls_cert, tr.tls_key, tr.tls_ca]
    need(all(tls) or not any(tls), "--tls-cert, --tls-key and --tls-ca go together")
    for path in filter(None, tls):
        need(Path(path).is_file(), f"TLS file not found: {path}")
    need(not (all(tls) and tr.plaintext), "--plaintext contradicts the TLS files given")
    need(tr.timeout_s > 0, f"--timeout must be > 0 s, got {tr.timeout_s}")
    need(tr.data_port == 0 or 1 <= tr.data_port <= 65535 - 64,
         f"--data-port must be 0 (the kernel picks) or in [1, {65535 - 64}] (+ local rank), got {tr.data_port}")
    need(not tr.advertise_address or tr.data_port, "--advertise-address needs --data-port: whatever is in front "
         "of the rank (a load balancer, a NodePort, a NAT) forwards a port it knows")
    if tr.advertise_address:
        host, sep, port = tr.advertise_address.rpartition(":")
        if not sep or "]" in port:  # HOST, or a bracketed IPv6 literal without a port
            host, port = tr.advertise_address, ""
        need(bool(host.strip("[]")) and not any(c.isspace() for c in tr.advertise_address)
             and (port == "" or (port.isdigit() and 1 <= int(port) <= 65535 - 64)),
             f"--advertise-address must be HOST or HOST:PORT (port in [1, {65535 - 64}]), "
             f"got {tr.advertise_address!r}")


#: every check, in the order its problems are listed
CHECKS: tuple[Callable[[Config], list[str]], ...] = (
    field_problems, guard_problems, fault_problems, model_data_inner_problems, outer_problems, sync_problems,
    topology_problems, train_problems, auto_problems, codec_problems, transport_problems,
)


def problems(cfg: Config) -> list[str]:
    """Every problem of ``cfg``, one sentence each naming its flag (empty: valid)."""
    return [p for check in CHECKS for p in check(cfg)]
