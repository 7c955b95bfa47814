"""``--codec auto`` / ``--h auto`` in a running job: measure, agree, decide once, before the engine.

Every group must run the same setting from the same exchange on, so every group decides from
numbers every group holds bit for bit:

* the inner step: each rank times forward and backward passes of the task's first eval batch (no
  optimizer step, RNG states restored, gradients dropped); a group takes its slowest rank, and one
  exact exchange (fp32, no codec) gives every group every group's time; the slowest group's counts;
* the link: the coordinator's bandwidth table pinned for the next block of exchanges (asked after
  that exchange, by which every rank of every group has reported its first probe), whose slowest
  group-to-group capacity every group derives with the same pure function.

The choice (``diloco.job.auto_choice.choose``) is then the same on every rank. The codec is
chosen once, at start, before the engine is built, so the engine never changes codec mid-run:
error-feedback residuals and outer momentum start empty under the chosen setting.

With ``--h auto``, H is re-decided while the job runs (``AutoH``): at every launch, after the
averager fetched the bandwidth table the coordinator pinned for that exchange (the same table on
every rank of every group), a slowest link that moved by more than ``RELINK_THRESHOLD`` from the
one last decided on (hysteresis) re-runs the rule among the study's settings that differ from the
running one in H only (``auto_choice.choose_h``). The next round takes the new H on every group
alike; outer momentum and error-feedback residuals carry over (neither depends on H). With a
fixed ``--h``, such a change is logged with what ``auto`` would choose now, and the setting stays.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from diloco.engine.schedule import fixed_period
from diloco.job import auto_choice
from diloco.job.auto_choice import Choice
from diloco.job.config import Config, ConfigError, make_codec

log = logging.getLogger(__name__)

TIMED_STEPS = 3  # forward+backward passes timed (after one untimed)


def measure_step_seconds(model: torch.nn.Module, task: Any, device: torch.device) -> float:
    """Seconds of one forward and backward pass of ``model`` on the task's first eval batch (the
    median of ``TIMED_STEPS``); leaves parameters, gradients and RNG states as they were."""
    from diloco.job.task import to_device

    if not task.eval_batches:
        raise ConfigError("--codec auto / --h auto time the inner step on the task's first eval batch; this task "
                          "has no eval_batches")
    batch = to_device(task.eval_batches[0], device)
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    times = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(TIMED_STEPS + 1):
            for p in params:
                p.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            task.loss(model, batch).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
    for p, g in zip(params, saved):
        p.grad = g
    return statistics.median(times)


def agree_step_seconds(link: Any, step_s: float, *, group: int, groups: int, device: torch.device) -> dict[int, float]:
    """Every group's inner-step seconds (its slowest rank's), the same on every rank: one exact
    exchange of ``[s_g at g, 1 at groups + g]``, whose weighted mean divides back to each ``s_g``."""
    mine = torch.tensor([step_s], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and link.group_size > 1:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=link.process_group)
    vec = torch.zeros(2 * groups, dtype=torch.float32)
    vec[group], vec[groups + group] = float(mine.item()), 1.0
    mean = link.start(vec, tag="auto/step-seconds", exact=True).wait().to("cpu", torch.float64)
    return {g: float(mean[g] / mean[groups + g]) for g in range(groups) if mean[groups + g] > 0}


def slowest_link_now(link: Any) -> tuple[int, float]:
    """(plan version, bytes/s of the slowest group-to-group link) from the coordinator's table
    pinned for the next block of exchanges: the same answer for every rank."""
    averager = link.averager
    block = (averager.exchanges // averager.plan_every + 1) * averager.plan_every
    version, table = averager.call_coordinator("network plan", lambda: link.client.plan(block))
    members = link.membership
    sizes = {g: len(members.ranks(g)) for g in members.groups}
    return version, auto_choice.slowest_link(table, sizes)


def runnable_table(cfg: Config, table: auto_choice.AutoTable) -> auto_choice.AutoTable:
    """The table's settings this job's config can run (the others, e.g. 2 fragments of a 1-layer
    model, are left out before choosing)."""
    keep = []
    for e in table.entries:
        try:
            auto_choice.apply_choice(cfg, e).validate()
        except ConfigError:
            continue
        keep.append(e)
    return auto_choice.AutoTable(table.size, table.study_dates, table.commit, table.regenerate, tuple(keep))


def decide(cfg: Config, link: Any, *, model: torch.nn.Module, task: Any, device: torch.device, group: int,
           num_params: int) -> tuple[Config, Choice]:
    """Measure, agree and choose (see the module doc); returns the config to run and the choice.
    Switches ``link``'s averager to the chosen codec; logs the choice and shows it in the metrics
    and progress reports."""
    codec_auto, h_auto = auto_choice.is_auto(cfg)
    own = measure_step_seconds(model, task, device)
    steps = agree_step_seconds(link, own, group=group, groups=cfg.topology.groups, device=device)
    version, bandwidth = slowest_link_now(link)
    table = runnable_table(cfg, auto_choice.load_table())
    try:
        choice = auto_choice.choose(table, num_params=num_params, link_bytes_per_s=bandwidth, step_s=max(steps.values()),
                                    groups=cfg.topology.groups, codec=None if codec_auto else cfg.transport.codec,
                                    h=None if h_auto else cfg.sync.h)
    except ValueError as e:
        raise ConfigError(f"--codec/--h auto: {e}") from None
    chosen = auto_choice.apply_choice(cfg, choice.setting).validate()
    codec = make_codec(chosen.transport)
    averager = link.averager
    averager.codec, averager.error_feedback = codec, bool(getattr(codec, "requires_error_feedback", False))
    averager._stripe_plans.clear()  # aligned to the new codec's chunks from the next exchange
    link.auto = {"step_s_per_group": {str(g): s for g, s in steps.items()},
                 "table": f"{table.size} ({', '.join(table.study_dates)}, {table.commit})"}
    _show(link, choice, bandwidth, version)
    link.auto_choice = choice
    link.auto_inputs = {"table": table, "num_params": num_params, "step_s": max(steps.values()),
                        "groups": cfg.topology.groups, "codec": None if codec_auto else cfg.transport.codec,
                        "h": None if h_auto else cfg.sync.h}
    link.auto_bandwidth = bandwidth
    log.info("auto: %s", choice.reason, extra={"auto": link.auto})
    return chosen, choice


class AutoH:
    """A ``SyncSchedule`` whose H follows the link (see the module doc); wraps the run's fixed
    schedule and keeps its total steps."""

    def __init__(self, base: Any, link: Any, choice: Choice, table: auto_choice.AutoTable, *, num_params: int,
                 step_s: float, groups: int) -> None:
        self.base, self.link, self.choice, self.table = base, link, choice, table
        self.num_params, self.step_s, self.groups = num_params, step_s, groups
        self.decided_bytes_per_s = choice.link_bytes_per_s
        self.total_steps = getattr(base, "total_steps", None)
        self.h_max = getattr(base, "h_max", None)
        self.h = choice.setting.h
        self.changes: list[tuple[int, int, float]] = []  # (inner step, new H, link bytes/s)
        self._seen_version: int | None = None

    def period(self, step: int, lr: float) -> int:
        self._redecide(step)
        return fixed_period(step, h=self.h, total_steps=self.total_steps, h_max=self.h_max)

    def _redecide(self, step: int) -> None:
        current = getattr(self.link.averager, "_table", None)  # (block, version, table) of the exchange just launched
        if current is None or current[1] == self._seen_version:
            return
        self._seen_version = current[1]
        members = self.link.membership
        try:
            now = auto_choice.slowest_link(current[2], {g: len(members.ranks(g)) for g in members.groups})
        except ValueError:
            return
        if not auto_choice.link_changed(self.decided_bytes_per_s, now):
            return
        self.decided_bytes_per_s = now
        choice = auto_choice.choose_h(self.table, self.choice.setting, num_params=self.num_params,
                                      link_bytes_per_s=now, step_s=self.step_s, groups=self.groups)
        old = self.h
        self.choice, self.h = choice, choice.setting.h
        if self.h == old:
            log.info("auto: the slowest link moved to %.3g Mbit/s (plan version %d): H stays %d: %s",
                     8 * now / 1e6, current[1], old, choice.reason)
        else:
            self.changes.append((step, self.h, now))
            log.warning("auto: the slowest link moved to %.3g Mbit/s (plan version %d): H %d -> %d from step %d: %s",
                        8 * now / 1e6, current[1], old, self.h, step, choice.reason)
        _show(self.link, choice, now, current[1])
        self.link.auto["h_changes"] = [{"step": st, "h": h, "link_bytes_per_s": bw} for st, h, bw in self.changes]


def _show(link: Any, choice: Choice, bandwidth: float, version: int) -> None:
    """The choice in the link's summary/progress fields and in the metrics."""
    link.auto = {**(link.auto or {}), "row": choice.setting.row, "setting": choice.setting.label,
                 "reason": choice.reason, "hides": choice.hides, "wire_s": choice.wire_s, "budget_s": choice.budget_s,
                 "link_bytes_per_s": bandwidth, "plan_version": version, "short": choice.short}
    link.metrics.auto_decided({"row": choice.setting.row, "setting": choice.setting.label, "codec": choice.setting.codec,
                               "h": str(choice.setting.h), "mode": choice.setting.mode, "hides": str(choice.hides).lower(),
                               "reason": choice.reason})


def install_auto_h(engine: Any, link: Any, cfg: Config) -> AutoH | None:
    """With ``--h auto`` (as given, before the choice): H follows the link for the rest of the run."""
    inputs = getattr(link, "auto_inputs", None)
    if inputs is None or inputs["h"] is not None or not hasattr(engine, "schedule"):
        return None
    schedule = AutoH(engine.schedule, link, link.auto_choice, inputs["table"], num_params=inputs["num_params"],
                     step_s=inputs["step_s"], groups=inputs["groups"])
    engine.schedule = schedule
    link.auto_schedule = schedule
    return schedule


def watch_link(link: Any) -> None:
    """After a re-probe: when the slowest link in the averager's current table differs from the one
    decided on by more than the hysteresis, log what ``auto`` would choose now (once per table)."""
    current = getattr(link.averager, "_table", None)
    decided = getattr(link, "auto_bandwidth", None)
    if current is None or decided is None or getattr(link, "auto_schedule", None) is not None \
            or current[1] == getattr(link, "_auto_seen_version", None):
        return  # no decision, H follows the link (AutoH), or a table already seen
    link._auto_seen_version = current[1]
    members = link.membership
    try:
        now = auto_choice.slowest_link(current[2], {g: len(members.ranks(g)) for g in members.groups})
    except ValueError:
        return
    if auto_choice.link_changed(decided, now):
        would = auto_choice.choose(link_bytes_per_s=now, **link.auto_inputs)
        log.warning("auto: the slowest link is now %.3g Mbit/s (decided on %.3g, plan version %d): auto would now "
                    "choose %s; the setting chosen at start stays (auto decides once per run)",
                    8 * now / 1e6, 8 * decided / 1e6, current[1], would.reason)
