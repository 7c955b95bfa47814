"""Typed configuration: dataclass sections, loadable from TOML/JSON, overridable from the CLI.

Every field carries its help text and command-line flag, so ``diloco run --help`` documents
every option with its default, and a TOML file uses the same names grouped by section::

    [sync]
    schedule = "qsr"
    h = 30

Defaults follow the literature where it has one (outer Nesterov lr 0.7 / momentum 0.9,
DiLoCo §1.2) and otherwise are sized so the embedded demo finishes in a few minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from diloco.engine.modes import INITIAL_SYNCS, MODE_TRAITS, MODES
from diloco.engine.schedule import SyncSchedule
from diloco.engine.outer_spec import OuterSpec, outer_rule_names
from diloco.engine.schedule_spec import ScheduleSpec, schedule_names
from diloco.job import config_checks
from diloco.job.auto_choice import AUTO_H
from compress.codec_spec import CodecOptions, CodecSpec, codec_names
from transport.link_spec import DATA_PLANES, DEFAULT_CHUNK_BYTES, link_names

INNER_OPTIMIZERS = ("adamw", "adam", "sgd")
OUTER_OPTIMIZERS = outer_rule_names()  # diloco.engine.outer_spec.OUTER_RULES
SCHEDULES = schedule_names()  # diloco.engine.schedule_spec.SCHEDULES
LR_SCHEDULES = ("cosine", "constant")
LOG_FORMATS = ("text", "json")
CHAOS_KINDS = ("kill", "stall", "corrupt")  # diloco run --chaos-kinds
BACKENDS = ("auto", "gloo", "nccl")
PARALLELS = ("auto", "ddp", "fsdp")  # inside a group: replicate (DDP) or shard (FSDP2); auto: as the Task asks
OUTER_DEVICES = ("model", "cpu")
LINKS = link_names()  # transport.link_spec.LINKS
SYNC_MODES = (*MODES, "dp")  # dp: the data-parallel baseline, not an engine mode
FRAGMENT_PATTERNS = ("strided", "sequential")


# the options most runs set: ``diloco run --help`` shows them first, in this order ("section.field");
# every other option is shown in its section's group (the section's docstring says what it holds)
EVERYDAY = (
    "topology.groups", "topology.ranks_per_group", "train.steps", "sync.h", "sync.mode", "transport.codec",
    "transport.link", "train.entry", "fault.spares",
)


class ConfigError(ValueError):
    """An invalid setting; the message names the option and the allowed values."""


def opt(default: Any, help: str, flag: str | None = None, choices: tuple[str, ...] | None = None):
    """A config field with its CLI flag and help text."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


@dataclass
class ModelConfig:
    """The demo GPT's shape (an --entry task builds its own model)."""

    n_layer: int = opt(2, "transformer blocks", flag="--n-layer")
    n_head: int = opt(4, "attention heads per block", flag="--n-head")
    n_embd: int = opt(128, "embedding width", flag="--n-embd")
    block_size: int = opt(64, "context length in tokens", flag="--block-size")
    dropout: float = opt(0.0, "dropout probability", flag="--dropout")


@dataclass
class DataConfig:
    """The demo's corpus and batches."""

    path: str = opt(
        "", "text directory, text file or uint16 .bin tokens; empty = bundled Shakespeare",
        flag="--data",
    )
    val_fraction: float = opt(0.05, "tail fraction of the corpus held out for eval", flag="--val-fraction")
    batch_size: int = opt(16, "sequences per rank per inner step", flag="--batch-size")
    eval_batches: int = opt(20, "validation batches for the final eval loss", flag="--eval-batches")
    order: str = opt(
        "random", "demo windows: random (with replacement, per-rank seeds) or epochs (disjoint windows in a "
        "seeded permutation per epoch: each trained once per epoch)", flag="--data-order", choices=("random", "epochs"),
    )


@dataclass
class InnerConfig:
    """Each rank's inner optimizer and its learning-rate schedule."""

    optimizer: str = opt("adamw", "inner optimizer", flag="--inner-optimizer", choices=INNER_OPTIMIZERS)
    lr: float = opt(1e-3, "peak inner learning rate", flag="--inner-lr")
    weight_decay: float = opt(0.1, "inner weight decay", flag="--weight-decay")
    warmup_steps: int = opt(20, "linear lr warmup, inner steps", flag="--warmup-steps")
    lr_schedule: str = opt("cosine", "inner lr decay after warmup", flag="--lr-schedule", choices=LR_SCHEDULES)
    min_lr_ratio: float = opt(0.1, "cosine floor as a fraction of the peak lr", flag="--min-lr-ratio")
    grad_clip: float = opt(1.0, "clip inner gradients at this global L2 norm (0 = off)", flag="--grad-clip")


@dataclass
class OuterConfig:
    """The outer step every group applies to the averaged pseudo-gradient."""

    optimizer: str = opt(
        "nesterov", "outer optimizer on the pseudo-gradient; sparseloco: SparseLoCo's rule (outer SGD, no momentum, "
        f"the error-feedback residual decayed by --sparseloco-beta, top-k per 64x64 tile; needs --codec "
        f"{', '.join(codec_names(error_feedback=True)[:-1])} or {codec_names(error_feedback=True)[-1]})",
        flag="--outer-optimizer", choices=OUTER_OPTIMIZERS)
    # -1: the sync mode's own default (diloco.engine.modes.MODE_DEFAULTS, measurements in outer.py's doc):
    # a one-round-stale outer gradient under momentum 0.9 overshoots (eager: +11 % loss) or diverges (delayed)
    lr: float = opt(-1.0, "outer learning rate; -1 = the mode's default (0.7; sparseloco: 1.0)", flag="--outer-lr")
    momentum: float = opt(
        -1.0, "outer momentum (nesterov, sgd); -1 = the mode's default: 0.9 (DiLoCo's), 0.5 for eager and 0 "
        "for delayed, whose stale outer gradients overshoot with 0.9 (delayed diverges)", flag="--outer-momentum",
    )
    device: str = opt("model", "where the fp32 global copy lives", flag="--outer-device", choices=OUTER_DEVICES)
    alpha: float = opt(
        -1.0, "merge factor: local = alpha*local + (1-alpha)*global after a sync; "
        "-1 = the mode's default (0.5 for overlap, else 0)", flag="--merge-alpha",
    )
    co2_lr: float = opt(1.0, "CO2 outer lr (authors' default)", flag="--co2-lr")
    co2_momentum: float = opt(0.0, "CO2 outer momentum (authors' default for <= 16 GPUs; 0.2-0.6 above)", flag="--co2-momentum")
    co2_penalty: str = opt("adaptive", "CO2 staleness-gap penalty: 'adaptive' or a constant >= 1", flag="--co2-penalty")
    co2_clip: float = opt(1.0, "CO2 element-wise outer-momentum clip (0 = off)", flag="--co2-clip")
    sparseloco_beta: float = opt(0.95, "sparseloco: decay of the error-feedback residual, y = delta + beta*e "
                                 "(Covenant-72B's 0.95)", flag="--sparseloco-beta")
    residual_decay: float = opt(1.0, f"codecs with error feedback ({', '.join(codec_names(error_feedback=True))}) "
                                "under an outer step other than "
                                "sparseloco's: decay of the residual, y = delta + decay*e; 1 sends every error later, "
                                "0 drops each exchange's error (the codec runs biased)", flag="--residual-decay")

    def spec(self) -> OuterSpec:
        """The outer rule these options name (``diloco.engine.outer_spec``: its defaults, checks, build)."""
        return OuterSpec(**{f.name: getattr(self, f.name) for f in fields(OuterSpec)})

    def outer_lr(self, mode: str) -> float:
        """The outer lr in force for a sync mode (not co2: --co2-lr; sparseloco: 1.0 by default)."""
        return self.spec().lr_for(mode)

    def outer_momentum(self, mode: str) -> float:
        """The outer momentum in force for a sync mode (not co2: --co2-momentum; sparseloco: none)."""
        return self.spec().momentum_for(mode)

    def merge_alpha(self, mode: str) -> float:
        """The merge factor in force for a sync mode."""
        return self.spec().alpha_for(mode)


@dataclass
class SyncConfig:
    """When the groups exchange: H, its schedule, the sync mode and fragments."""

    schedule: str = opt("fixed", "how H (inner steps per sync) is chosen", flag="--schedule", choices=SCHEDULES)
    h: int | str = opt(30, "H for 'fixed'; H_base for 'qsr'; for 'paced' the mean H (ceil(--steps / H) syncs); auto: "
                 "chosen with the codec from the measured link (diloco/job/auto_choice.py)", flag="--h")
    qsr_alpha: float = opt(
        -1.0, "QSR alpha: H = max(H_base, floor((alpha/lr)^gamma)); -1 = peak inner lr x H_base^(1/gamma) "
        "(H = H_base at the peak lr, x4 at half of it)", flag="--qsr-alpha",
    )
    qsr_gamma: float = opt(2.0, "QSR exponent gamma", flag="--qsr-gamma")
    paced_gamma: float = opt(
        0.5, "'paced': the syncs fixed H would make, planned so that H grows as (peak lr / lr)^gamma along the inner "
        "lr's decay (0 = fixed H; 0.5 with int2 at H=200: a lower loss than fixed H on every seed, "
        "bench/pages/convergence.md)", flag="--paced-gamma",
    )
    h_max: int = opt(0, "upper bound on H (0 = only the remaining steps)", flag="--h-max")
    mode: str = opt(
        "blocking", f"{', '.join(t.summary for t in MODE_TRAITS.values())}, "
        "or dp (data parallel: gradients averaged across groups every step, the baseline)",
        flag="--mode", choices=SYNC_MODES,
    )
    fragments: int = opt(1, "fragments P synced at staggered times (Streaming DiLoCo)", flag="--fragments")
    fragment_pattern: str = opt("strided", "blocks to fragments: strided or sequential", flag="--fragment-pattern", choices=FRAGMENT_PATTERNS)
    overlap_steps: int = opt(1, "tau: inner steps a fragment's exchange overlaps (mode overlap)", flag="--overlap-steps")
    round_seconds: float = opt(
        0.0, "rounds by time: each group trains S seconds per round (blocking: from the previous commit; overlap: on a "
        "fixed grid, each fragment's staggered by S/P), as many steps as its speed allows, and the mean weighs each "
        "group's tokens; the job runs ceil(--steps / --h) rounds of each fragment and the inner lr follows the rounds' "
        "time; modes blocking and overlap; 0 = off (rounds of H steps)",
        flag="--round-seconds",
    )

    def qsr_alpha_for(self, peak_lr: float) -> float:
        """QSR's alpha in force: ``--qsr-alpha``, or for -1 the one that gives H = H_base at the peak
        inner lr (``peak_lr * H_base**(1/gamma)``), so H grows by (peak/lr)^gamma as the lr decays,
        whatever the lr's scale."""
        return ScheduleSpec(h=self.h, qsr_alpha=self.qsr_alpha, qsr_gamma=self.qsr_gamma,
                            peak_lr=peak_lr).qsr_alpha_in_force


@dataclass
class TopologyConfig:
    """How many groups, how many ranks in each, and how a group runs its model."""

    groups: int = opt(2, "worker groups (datacenters)", flag="--groups")
    ranks_per_group: int = opt(2, "torchrun ranks per group", flag="--ranks-per-group")
    group_sizes: str = opt("", "ranks of each group, comma-separated (e.g. 2,1,3); overrides --ranks-per-group", flag="--group-sizes")
    backend: str = opt("auto", "in-group backend (auto = nccl with CUDA, else gloo)", flag="--backend", choices=BACKENDS)
    parallel: str = opt(
        "auto", "inside a group: ddp replicates the model on every rank, fsdp shards it (FSDP2: each rank holds "
        "and exchanges its shard only); auto = fsdp if the task asks for it (Task.shard), else ddp",
        flag="--parallel", choices=PARALLELS,
    )
    threads_per_rank: int = opt(
        0, "torch CPU threads per rank; 0 = the rank's share of the container's CPU request ($DILOCO_CPU_REQUEST, "
        "whole cores, shared by the node's ranks), else of the cgroup's CPU quota, else 1", flag="--threads-per-rank",
    )

    def sizes(self) -> list[int]:
        """Ranks of every group, in group order."""
        if self.group_sizes:
            return [int(x) for x in self.group_sizes.split(",")]
        return [self.ranks_per_group] * self.groups


@dataclass
class TrainConfig:
    """The run: steps, seed, what it trains, logging, metrics and job checkpoints."""

    steps: int = opt(300, "inner steps per rank", flag="--steps")
    seed: int = opt(1337, "seed for the model init (all groups) and data sampling", flag="--seed")
    log_every: int = opt(5, "report progress every N inner steps", flag="--log-every")
    progress_every: float = opt(
        60.0, "rank 0 of each group logs a progress line (step, loss, lr, throughput, round, bytes sent) at most "
        "every this many seconds, at a --log-every step; 0 = never", flag="--progress-every",
    )
    metrics_port: int = opt(
        0, "serve Prometheus /metrics on this port + local rank (diloco run offsets each group); 0 = off",
        flag="--metrics-port",
    )
    log_format: str = opt(
        "text", "log lines: text for people, json (one object per line, with group and rank) for collectors",
        flag="--log-format", choices=LOG_FORMATS,
    )
    save: str = opt("", "write the final global model here (atomic; group 0 writes it); empty = don't", flag="--save")
    entry: str = opt(
        "", "what to train: package.module:function taking a diloco.TaskContext and returning a "
        "diloco.Task; empty = the demo GPT (diloco.demo:gpt_task)", flag="--entry",
    )
    entry_args: str = opt("", "KEY=VALUE pairs, comma-separated, passed to --entry as ctx.args", flag="--entry-args")
    initial_sync: str = opt(
        "check", "start: check that every group built the same initial parameters (refuse if not), "
        "or copy group 0's to all", flag="--initial-sync", choices=INITIAL_SYNCS,
    )
    checkpoint_every: int = opt(
        0, "write a job checkpoint (everything needed to resume) every N inner steps; 0 = off",
        flag="--checkpoint-every",
    )
    checkpoint_dir: str = opt(
        "", "folder of job checkpoints (diloco run: RUN_DIR/checkpoints when checkpoints are on; "
        "diloco run --resume DIR: DIR)", flag="--checkpoint-dir",
    )
    checkpoint_keep: int = opt(3, "job checkpoints kept, newest first (>= 2; 0 = keep all)", flag="--checkpoint-keep")
    stop_grace: float = opt(
        20.0, "after a rank's own SIGTERM (a deleted or drained pod), the longest it waits to reach its next job "
        "checkpoint before it stops without one, exit 75 (a restarted group heals from a live one), seconds; keep it "
        "under the pod's terminationGracePeriodSeconds and torchrun's 30 s SIGTERM-to-SIGKILL; 0 = stop at once",
        flag="--stop-grace",
    )
    stop_after: int = opt(
        0, "stop after this inner step (< --steps; the lr schedule still follows --steps), write a job "
        "checkpoint and exit 0; 0 = run to --steps", flag="--stop-after",
    )


@dataclass
class _Endpoint:
    """The first options of ``[transport]``: where this rank listens, its links and their pipelining."""

    host: str = opt("127.0.0.1", "address this rank's data plane listens on and advertises", flag="--host")
    data_port: int = opt(
        0, "port this rank's data plane listens on: this + the rank's local rank (a fixed port a Service, "
        "NodePort or firewall can name; under diloco run, group g's ranks add the ranks of groups 0..g-1, so "
        "the job takes --data-port .. --data-port + all ranks - 1); 0 = one the kernel picks", flag="--data-port",
    )
    advertise_address: str = opt(
        "", "address the other groups dial to reach this rank, when it is not --host (a load balancer, NodePort "
        "or NAT in front of it): HOST (with the port listened on) or HOST:PORT (PORT + the local rank)",
        flag="--advertise-address",
    )
    timeout_s: float = opt(60.0, "deadline for any cross-group wait, seconds", flag="--timeout")
    link: str = opt("tcp", "data-plane link type between groups", flag="--link", choices=LINKS)
    data_plane: str = opt("thread", "where each rank's transport runs: thread (in the trainer's process) or process "
                          "(a child process: its per-chunk Python never holds the trainer's interpreter lock; "
                          "vectors cross through shared memory; bench/pages/gil.md)",
                          flag="--data-plane", choices=DATA_PLANES)
    connections: int = opt(1, "connections per peer; chunks are spread across them", flag="--connections")
    chunk_bytes: int = opt(DEFAULT_CHUNK_BYTES, "pipelining unit of the ring, bytes of fp32 input", flag="--chunk-bytes")


@dataclass
class TransportConfig(CodecOptions, _Endpoint):
    """The data plane between groups: addresses, link, codec, bandwidth probes, TLS and limits."""

    # fields: the endpoint's (_Endpoint), the codec's (compress.codec_spec.CodecOptions, spelled there),
    # then these

    def codec_spec(self) -> CodecSpec:
        """The codec these options name (its ``build()`` makes it; ``final()`` the last exchange's)."""
        return CodecSpec.of(self)

    probe_bytes: int = opt(1 << 19, "bytes per bandwidth probe to each other group (0 = no probes: equal stripes, sorted ring)", flag="--probe-bytes")
    reprobe_every: int = opt(100, "re-measure bandwidths in the background every N exchanges (0 = only at start)", flag="--reprobe-every")
    plan_every: int = opt(8, "exchanges that share one plan (ring order, stripe shares) from the coordinator", flag="--plan-every")
    stripes_per_rank: int = opt(4, "stripes per rank of the largest group (finer = better balance, more rings)", flag="--stripes-per-rank")
    tls_cert: str = opt("", "this rank's TLS certificate (PEM); with --tls-key and --tls-ca turns on mutual TLS", flag="--tls-cert")
    tls_key: str = opt("", "this rank's TLS private key (PEM)", flag="--tls-key")
    tls_ca: str = opt("", "CA certificate that signs every peer (PEM)", flag="--tls-ca")
    plaintext: bool = opt(False, "allow an unencrypted data plane on non-loopback addresses (explicit opt-in)", flag="--plaintext")
    # what a stranger can hold on this rank's listener before it authenticates (transport.guard)
    handshake_timeout: float = opt(10.0, "seconds from accept in which an incoming connection must finish its "
                                   "whole handshake (TLS included), however slowly bytes arrive", flag="--handshake-timeout")
    max_unauthenticated: int = opt(64, "incoming connections from strangers' addresses that may be unauthenticated "
                                   "at once (members' addresses have reserved slots besides)", flag="--max-unauthenticated")
    max_unauthenticated_per_source: int = opt(8, "of those, how many from one source address",
                                              flag="--max-unauthenticated-per-source")
    max_pending_bytes: int = opt(256 << 20, "bytes of frames kept for exchanges not yet started here (kept at most "
                                 "2 x --timeout)", flag="--max-pending-bytes")


@dataclass
class FaultConfig:
    """Failures: heartbeats, quorums, refused pseudo-gradients, restarts, warm spares and the fault drill."""

    heartbeat_timeout: float = opt(
        15.0, "seconds without a message from any rank of a group before the group is declared failed "
        "and left out of the next quorum (ranks heartbeat every fifteenth of it)", flag="--heartbeat-timeout",
    )
    min_groups: int = opt(1, "fewest groups an exchange may run with (a control exchange counts the groups healing in); below it the survivors wait", flag="--min-groups")
    quorum_grace: float = opt(
        0.0, "seconds an exchange waits, after the first group asked for it, for the other live groups; then "
        "it runs with those that asked (at least --min-groups) and a group left out heals, losing its round's "
        "work (0 = off: wait for every live group until the heartbeat timeout, as a deterministic run needs)",
        flag="--quorum-grace",
    )
    outlier_factor: float = opt(
        10.0, "refuse a group's pseudo-gradient whose norm exceeds this multiple of the median of its last "
        "8 accepted (0 = only NaN/Inf are refused)", flag="--outlier-factor",
    )
    max_restarts: int = opt(3, "diloco run: times each group is restarted after it fails (it then heals)", flag="--max-restarts")
    spares: int = opt(
        0, "diloco run: processes kept started (python, torch and the worker imported) that become a restarted "
        "group at once, instead of a new process that imports them first (seconds, more on a busy host); "
        "groups of one rank on this host", flag="--spares",
    )
    chaos: int = opt(0, "diloco run: kill N random groups at random moments and restart them (a fault drill)", flag="--chaos")
    chaos_kinds: str = opt(
        "kill", "diloco run --chaos: the faults' kinds, comma-separated, each fault's drawn from them: kill (a "
        "group's processes, restarted), stall (a group frozen for 2-3 heartbeat timeouts), corrupt (one bit "
        "flipped in what a group receives, by a relay in front of its data plane; groups of one rank)",
        flag="--chaos-kinds",
    )

    def kinds(self) -> tuple[str, ...]:
        """``chaos_kinds`` as a tuple, without blanks."""
        return tuple(k.strip() for k in self.chaos_kinds.split(",") if k.strip())

    def kinds_problem(self) -> str | None:
        """Why ``chaos_kinds`` names no fault kind or an unknown one; None when it is valid."""
        if self.kinds() and set(self.kinds()) <= set(CHAOS_KINDS):
            return None
        return f"--chaos-kinds must be some of {', '.join(CHAOS_KINDS)}, comma-separated, got {self.chaos_kinds!r}"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def schedule_spec(self) -> ScheduleSpec:
        """The sync schedule these options name (``--schedule``, ``--h`` and theirs, over ``--steps`` and the
        inner lr's shape); with ``--h auto`` H is None until auto decides (``auto_choice.apply_choice``)."""
        s, i = self.sync, self.inner
        return ScheduleSpec(name=s.schedule, h=None if s.h == AUTO_H else s.h, total_steps=self.train.steps, h_max=s.h_max, qsr_alpha=s.qsr_alpha,
                            qsr_gamma=s.qsr_gamma, paced_gamma=s.paced_gamma, round_seconds=s.round_seconds,
                            peak_lr=i.lr, warmup_steps=i.warmup_steps, lr_schedule=i.lr_schedule,
                            min_lr_ratio=i.min_lr_ratio)

    def engine_options(self, schedule: SyncSchedule | None = None) -> dict[str, Any]:
        """``make_engine``'s settings (``diloco.runtime.rank.worker``), built from these options:
        ``make_engine(model, inner, averager, **cfg.engine_options())``. ``schedule``: one built
        already (``--codec/--h auto``, a planned one), else this config's (``schedule_spec().build()``)."""
        return {"sync": self.sync, "outer": self.outer.spec(), "outer_device": self.outer.device,
                "schedule": schedule or self.schedule_spec().build(),
                "final_codec": self.transport.codec_spec().final(), "initial_sync": self.train.initial_sync}

    def validate(self) -> "Config":
        """Raise ConfigError naming every invalid setting (``diloco.job.config_checks``); returns self."""
        found = config_checks.problems(self)
        if found:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(found))
        return self


def iter_fields(cfg: Config):
    """Yield ``(section_name, field)`` for every leaf option."""
    for section in fields(cfg):
        for f in fields(getattr(cfg, section.name)):
            yield section.name, f
