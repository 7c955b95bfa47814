"""What ``diloco run`` prints at the end: the job's summary, from the groups' own summaries.

``summarize`` builds the summary dict (also written by ``--json``); ``format_summary`` prints it;
``bits_per_param_per_step`` and ``dp_bytes`` are what a run spent on its links and what data
parallel would have spent.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.exchange.data_positions import check_ledger, ledger_from_logs
from diloco.job.config import Config
from diloco.job.task import DEMO_ENTRY

if TYPE_CHECKING:
    from diloco.runtime.launch.supervise import Supervisor


def bits_per_param_per_step(bytes_sent: int, num_parameters: int, steps: int) -> float:
    """Bits all groups together sent to each other, per model parameter per inner step: what a run
    spent on its links. Data parallel over a ring spends ``64 (G-1)`` (64 with two groups): see
    ``dp_bytes``. 0 for a run of no steps."""
    return 8.0 * bytes_sent / (num_parameters * steps) if num_parameters and steps else 0.0


def dp_bytes(num_parameters: int, groups: int, steps: int, bytes_per_value: int = 4) -> int:
    """Bytes all groups together would send if they all-reduced fp32 gradients every step.

    A bandwidth-optimal ring moves ``2(G-1)/G`` of the vector per group per step.
    """
    if groups < 2:
        return 0
    return 2 * (groups - 1) * num_parameters * bytes_per_value * steps


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``37.2MB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n}"


def fault_summary(snapshot: dict, supervisor: Supervisor) -> dict:
    """What fault tolerance did in the job: the coordinator's counts and events (with the seconds of
    each exchange a failure disturbed, from its first quorum request to its commit), and the
    supervisor's kills and restarts."""
    rs = snapshot["rounds_state"]
    stalls = [e["seconds"] for e in rs["events"] if e["kind"] == "stall"]
    return {
        "kills": len(supervisor.kills), "frozen": len(supervisor.frozen), "corrupted": len(supervisor.corrupted),
        "restarts": sum(supervisor.restarts.values()), "spares_used": len(supervisor.spares_used),
        "failures": rs["failures"], "heals": rs["heals"], "rolled_back": rs["rolled_back"],
        "committed": rs["committed"], "rejected": rs["rejected"], "evicted": rs["evicted"],
        "stall_seconds": stalls, "events": rs["events"], "process_failures": supervisor.failures,
    }


def summarize(cfg: Config, corpus, per_group: list[dict], snapshot: dict, seconds: float, out_dir: Path) -> dict:
    """The run's summary dict from the groups' own summaries (``per_group``: those of the groups
    that finished the job, in group order) and the coordinator's last ``snapshot``."""
    n = int(per_group[0]["num_parameters"])
    sent = sum(int(s["bytes_sent"]) for s in per_group)
    # the steps this run took (a resumed or stopped run: its own part; otherwise --steps)
    steps_run = int(per_group[0].get("inner_steps", cfg.train.steps)) - int(per_group[0].get("resumed_at_step", 0))
    dp = dp_bytes(n, cfg.topology.groups, steps_run)
    hashes = {int(s["group"]): s["param_hash"] for s in per_group}
    return {
        "eval_loss": per_group[0]["eval_loss"],
        "eval_loss_per_group": {int(s["group"]): s["eval_loss"] for s in per_group},
        "initial_eval_loss": next((x for x in (float(g["initial_eval_loss"]) for g in per_group) if math.isfinite(x)),
                                  float("nan")),  # a group that healed in did not see the start
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
        "bits_per_param_per_step": bits_per_param_per_step(sent, n, steps_run),
        "dp_bits_per_param_per_step": bits_per_param_per_step(dp, n, steps_run),
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
        **{k: per_group[0][k] for k in ("resumed_from", "resumed_at_step", "stopped_at_step", "job_checkpoint", "auto",
                                         "exported")
           if k in per_group[0]},
        **({} if "resumed_from" in per_group[0] else {"data_per_group": data_counts(out_dir)}),
    }


def data_counts(run_dir: Path) -> dict[int, dict[str, int]]:
    """Each group's committed data, counted from every incarnation's log in ``run_dir``
    (``diloco.exchange.data_positions``): ``committed`` (its committed position, samples), and how
    many samples below it were committed ``twice`` or ``left_out`` (0 and 0: each trained once)."""
    lines = [line for path in sorted(Path(run_dir).glob("group-*.log"))
             for line in path.read_text(errors="replace").splitlines()]
    return {g: {"committed": c.end, "twice": sum(b - a for a, b in c.twice), "left_out": sum(b - a for a, b in c.gaps)}
            for g, c in sorted(check_ledger(ledger_from_logs(lines)).items())}


def format_summary(s: dict) -> str:
    """Human-readable summary block printed at the end of ``diloco run``."""
    lines = [
        "diloco run summary",
        f"  eval loss (global model) : {s['eval_loss']:.4f}{' nats/token' if s.get('entry') == DEMO_ENTRY else ''}"
        f" (initial {s['initial_eval_loss']:.4f})",
        f"  trained                  : {s.get('entry', DEMO_ENTRY)}",
        f"  sync mode                : {s['mode']}, {s['fragments']} fragment(s)",
        *([f"  codec between groups     : {_codec_line(s['config'])}"] if "config" in s else []),
        f"  outer rounds             : {s['outer_rounds']} (H per round: {_compact(s['periods'])})",
        f"  inner steps per rank     : {s['inner_steps']}",
        f"  groups (ranks each)      : {s['groups']} ({', '.join(map(str, s['ranks_per_group']))})",
        *([f"  placement                : {s['placement']}"] if s.get("placement") else []),
        f"  parameters               : {s['num_parameters']:,}",
        f"  bytes between groups     : {human_bytes(s['bytes_sent'])} ({s['bytes_sent']:,} B)",
        f"  data parallel would send : {human_bytes(s['dp_bytes'])} ({s['dp_bytes']:,} B)"
        + (f", {s['reduction_vs_dp']:.0f}x more" if s["reduction_vs_dp"] else ""),
        *([f"  bits / parameter / step  : {_bits(s['bits_per_param_per_step'])} between groups "
           f"(data parallel: {_bits(s['dp_bits_per_param_per_step'])})"] if "bits_per_param_per_step" in s else []),
        f"  global params identical  : {s['params_identical']} ({', '.join(s['param_hash_per_group'].values())})",
        f"  compute utilization      : {100 * s['utilization']:.1f}% (time in inner steps / wall, slowest group)",
        *([f"  global model written as  : {s['exported']} (Task.export)"] if s.get("exported") else []),
        f"  wall time                : {s['seconds']:.1f} s",
        f"  logs                     : {s['run_dir']}",
    ]
    f = s.get("fault")
    if f and (f["kills"] or f.get("frozen") or f["failures"] or f["rolled_back"] or f["rejected"]):
        stalls = f["stall_seconds"]
        stall = (f"; exchanges a failure disturbed took median {statistics.median(stalls):.2f} s, "
                 f"max {max(stalls):.2f} s") if stalls else ""
        frozen = f", {f['frozen']} frozen by the drill" if f.get("frozen") else ""
        frozen += f", {f['corrupted']} links corrupted by the drill" if f.get("corrupted") else ""
        spares = f" ({f['spares_used']} groups started from warm spares)" if f.get("spares_used") else ""
        lines.insert(-2, f"  faults                   : {f['kills']} killed by --chaos{frozen}, "
                         f"{f['failures']} group failures, {f['restarts']} restarts, {f['heals']} heals{spares}, "
                         f"{f['rolled_back']} rounds rolled back, {f['rejected']} contributions refused{stall}")
        data = s.get("data_per_group")
        if data:
            twice, left = sum(d["twice"] for d in data.values()), sum(d["left_out"] for d in data.values())
            counts = " / ".join(f"{d['committed']:,}" for d in data.values())
            lines.insert(-2, f"  data committed           : {counts} samples by group; {twice:,} counted twice, "
                             f"{left:,} left out (from the logs)")
    if s.get("auto"):
        lines.insert(4, f"  auto (--codec/--h auto)  : {s['auto']['reason']}")
    if s.get("resumed_from"):
        lines.insert(6, f"  resumed from             : {s['resumed_from']}")
    if s.get("stopped_at_step") is not None:
        root = Path(s["job_checkpoint"]).parent
        lines.insert(6, f"  stopped at step          : {s['stopped_at_step']} of {s['config']['train']['steps']}, "
                        f"checkpoint {s['job_checkpoint']} (continue: diloco run --resume {root})")
    return "\n".join(lines)


def _codec_line(config: dict) -> str:
    """``--codec`` as the job ran it: its block or density, zstd, the residual's decay and the last
    exchange's codec."""
    transport = config["transport"]
    line = transport["codec"]
    if transport.get("codec_block"):
        line += f" (--codec-block {transport['codec_block']})"
    if transport.get("topk_density"):
        line += f" (density {transport['topk_density']:g})"
    if transport.get("zstd"):
        line += " + zstd"
    decay = config.get("outer", {}).get("residual_decay", 1.0)
    if decay != 1.0:
        line += f", residual decay {decay:g} (--residual-decay)"
    if transport.get("final_codec"):
        line += f", the last exchange {transport['final_codec']} (--final-codec)"
    return line


def _bits(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.0f}"


def _compact(periods: list[int]) -> str:
    if not periods:
        return "none"
    if len(set(periods)) == 1:
        return f"{periods[0]} x{len(periods)}"
    return ", ".join(map(str, periods[:12])) + (" ..." if len(periods) > 12 else "")
