"""``--codec auto`` / ``--h auto`` in a running job: measure, agree, decide before the engine,
then follow the link.

Every group must run the same setting from the same exchange on, so every group decides from
numbers every group holds bit for bit:

* the inner step: each rank times forward and backward passes of the task's first eval batch (no
  optimizer step, RNG states restored, gradients dropped); a group takes its slowest rank, and one
  exact exchange (fp32, no codec) gives every group every group's time; the slowest group's counts;
* the link: the coordinator's bandwidth table pinned for the next block of exchanges (asked after
  that exchange, by which every rank of every group has reported its first probe), whose slowest
  group-to-group capacity every group derives with the same pure function.

The choice (``diloco.job.auto_choice.choose``) is then the same on every rank; it is made before
the engine is built, so error-feedback residuals and outer momentum start under it.

While the job runs (``AutoSchedule``), what was left to auto is re-decided: at every launch,
after the averager fetched the bandwidth table the coordinator pinned for that exchange (the same
table on every rank of every group), a slowest link that moved by more than ``RELINK_THRESHOLD``
from the one last decided on (hysteresis) re-runs the rule among the study's settings a running
job can switch to (``auto_choice.choose_relink``: the same outer rule, mode, fragments, schedule
and last exchange's codec; the codec, its block size, zstd and top-k density where ``--codec
auto``, H where ``--h auto``). The next exchange runs the new codec and the next round the new H
(under ``paced``, the plan of the new mean H from that step on), on every group alike. Outer
momentum carries over; an error-feedback residual carries over between codecs that keep one,
starts at zero when one starts keeping it, and is sent once, in the next Δ, when the new codec
keeps none (``DiLoCo.set_error_feedback``). An exchange already started keeps its codec, retries included.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from compress.codec_spec import CodecSpec
from diloco.engine.schedule import PacedSchedule, fixed_period
from diloco.job import auto_choice
from diloco.job.auto_choice import Choice
from diloco.job.config import Config, ConfigError

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


def running_setting(table: auto_choice.AutoTable, row: str, *, codec: str | None = None,
                    h: int | None = None) -> auto_choice.Setting:
    """``auto_choice.running_setting``, refused as a ConfigError."""
    try:
        return auto_choice.running_setting(table, row, codec=codec, h=h)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def settle(cfg: Config, link: Any, running: tuple[str, str] | None, *, model: torch.nn.Module, task: Any,
           device: torch.device, group: int, num_params: int) -> tuple[Config, AutoSchedule | None]:
    """``--codec auto`` / ``--h auto`` before the engine. ``running`` None: every group starts, so this
    one measures, agrees and chooses (``_decide``, see the module doc). Else (row, where from) of the
    setting a running job (this group heals) or its checkpoints (it resumes) runs (``_join``).
    Returns the config to build the engine with and, when the group joins, the schedule to build it
    with (None when it decided)."""
    codec_auto, h_auto = auto_choice.is_auto(cfg)
    codec, h = None if codec_auto else cfg.transport.codec, None if h_auto else cfg.sync.h
    if running is None:
        return _decide(cfg, link, model=model, task=task, device=device, group=group, num_params=num_params,
                       codec=codec, h=h), None
    return _join(cfg, link, running, num_params=num_params, codec=codec, h=h)


def _decide(cfg: Config, link: Any, *, model: torch.nn.Module, task: Any, device: torch.device, group: int,
            num_params: int, codec: str | None, h: int | None) -> Config:
    """Measure, agree and choose; switches ``link``'s averager to the chosen codec, logs the choice
    and shows it in the metrics and progress reports; returns the config to run."""
    own = measure_step_seconds(model, task, device)
    steps = agree_step_seconds(link, own, group=group, groups=cfg.topology.groups, device=device)
    version, bandwidth = slowest_link_now(link)
    study = auto_choice.load_table()
    table = runnable_table(cfg, study)
    try:
        choice = auto_choice.choose(table, num_params=num_params, link_bytes_per_s=bandwidth,
                                    step_s=max(steps.values()), groups=cfg.topology.groups, codec=codec, h=h)
    except ValueError as e:
        dropped = len(study.entries) - len(table.entries)
        raise ConfigError(f"--codec/--h auto: {e}" + (f" among the {len(table.entries)} this job's config can "
                          f"run ({dropped} fail its checks, e.g. SparseLoCo's tiles with --parallel fsdp)"
                          if dropped else "")) from None
    chosen = auto_choice.apply_choice(cfg, choice.setting).validate()
    switch_codec(link, None, cfg.transport.codec_spec(), choice.setting)
    link.auto = {"step_s_per_group": {str(g): s for g, s in steps.items()}, "table": _described(table)}
    _show(link, choice, bandwidth, version)
    link.auto_choice = choice
    link.auto_inputs = {"table": table, "num_params": num_params, "step_s": max(steps.values()),
                        "groups": cfg.topology.groups, "codec": codec, "h": h}
    link.auto_bandwidth = bandwidth
    log.info("auto: %s", choice.reason, extra={"auto": link.auto})
    return chosen


def _join(cfg: Config, link: Any, running: tuple[str, str], *, num_params: int, codec: str | None,
          h: int | None) -> tuple[Config, AutoSchedule]:
    """A group that joins a running job or resumes one runs ``running``'s setting, without a new
    decision: the engine's state, as it is loaded (the donor's or the checkpoint's), brings the
    choice's numbers and the changes so far. Returns the config and the schedule to build the
    engine with (waiting for that state), around the chosen config's own schedule (its total steps
    and cap kept)."""
    row, why = running
    table = runnable_table(cfg, auto_choice.load_table())
    setting = running_setting(table, row, codec=codec, h=h)
    chosen = auto_choice.apply_choice(cfg, setting).validate()
    switch_codec(link, None, chosen.transport.codec_spec(), setting)
    placeholder = Choice(setting, 0.0, 0.0, True, 0.0, 0.0, f"{setting.label}: {why}")
    link.auto = {"table": _described(table)}
    link.auto_choice = placeholder
    schedule = AutoSchedule(chosen.schedule_spec().build(), link, placeholder, table, num_params=num_params,
                            step_s=0.0, groups=cfg.topology.groups, codec=chosen.transport.codec_spec(),
                            codec_fixed=codec is not None, h_fixed=h is not None, waiting=True)
    link.averager.on_setting = schedule.take_setting
    link.auto_schedule = schedule
    log.info("auto: this group joins the job on %s (%s); the rest of the choice comes with the engine's state",
             setting.label, why)
    return chosen, schedule


def _described(table: auto_choice.AutoTable) -> str:
    """The table as the metrics and the log name it: its size, study dates and commit."""
    return f"{table.size} ({', '.join(table.study_dates)}, {table.commit})"


class AutoSchedule:
    """A ``SyncSchedule`` whose H, and with ``--codec auto`` the codec, follow the link (see the
    module doc); wraps the run's fixed schedule and keeps its total steps. ``engine``: the
    engine it schedules (its residuals follow the codec; None: H only, or bound as the engine is
    built, ``bind``). ``codec``: the codec options the job runs (the chosen config's
    ``TransportConfig.codec_spec()``: what a new codec is built from).
    ``codec_fixed`` / ``h_fixed``: what the user fixed (``--codec X --h auto``, ``--codec auto --h N``).

    Its state (``state_dict``: the setting, the link it was decided on, the changes) is part of the
    engine's, so a healer takes the donor's and a resumed job its checkpoint's. ``waiting=True``:
    built before that state is loaded (a healer, a resume): nothing is re-decided until it is."""

    def __init__(self, base: Any, link: Any, choice: Choice, table: auto_choice.AutoTable, *, num_params: int,
                 step_s: float, groups: int, engine: Any = None, codec: CodecSpec | None = None,
                 codec_fixed: bool = True, h_fixed: bool = False, waiting: bool = False) -> None:
        if not codec_fixed and codec is None:
            raise ValueError("a codec that follows the link needs the job's codec options")
        self.base, self.link, self.choice, self.table = base, link, choice, table
        self.num_params, self.step_s, self.groups = num_params, step_s, groups
        self.engine, self.codec, self.codec_fixed, self.h_fixed = engine, codec, codec_fixed, h_fixed
        self.decided_bytes_per_s = choice.link_bytes_per_s
        self.total_steps = getattr(base, "total_steps", None)
        self.h_max = getattr(base, "h_max", None)
        self.changes: list[tuple[int, int, float]] = []  # (inner step, new H, link bytes/s)
        self.codec_changes: list[tuple[int, str, float]] = []  # (inner step, new setting's label, link bytes/s)
        self._seen_version: int | None = None
        self._waiting = waiting

    @property
    def h(self) -> int:
        """H of the setting run now."""
        return self.choice.setting.h

    def bind(self, engine: Any) -> None:
        """The engine this schedule's codec switches reach (called as the engine is built)."""
        self.engine = engine

    def take_setting(self, row: str) -> None:
        """A healer joins an exchange that runs setting ``row``: run its codec from that exchange
        on (the choice itself comes with the donor's state)."""
        switch_codec(self.link, self.engine, self.codec, running_setting(self.table, row))

    def state_dict(self) -> dict:
        """The setting run now, the choice's numbers and the changes so far (plain values)."""
        c = self.choice
        return {"row": c.setting.row, "wire_s": c.wire_s, "budget_s": c.budget_s, "hides": c.hides,
                "link_bytes_per_s": c.link_bytes_per_s, "step_s": c.step_s, "reason": c.reason,
                "decided_bytes_per_s": self.decided_bytes_per_s,
                "changes": [list(x) for x in self.changes], "codec_changes": [list(x) for x in self.codec_changes]}

    def load_state_dict(self, state: dict) -> None:
        """Run the setting ``state`` names, from the next exchange on (its codec now, with the
        engine's residuals), and re-decide from the next pinned table on. Redeciding with a table
        already decided on gives the same answer (the link it was decided on moves with each
        change), so the plan version seen is not part of the state."""
        row = state["row"]
        setting = running_setting(self.table, row)
        self.choice = Choice(setting, float(state["wire_s"]), float(state["budget_s"]), bool(state["hides"]),
                             float(state["link_bytes_per_s"]), float(state["step_s"]), str(state["reason"]))
        self.step_s = float(state["step_s"])
        self.decided_bytes_per_s = float(state["decided_bytes_per_s"])
        self.changes = [(int(a), int(b), float(c)) for a, b, c in state["changes"]]
        self.codec_changes = [(int(a), str(b), float(c)) for a, b, c in state["codec_changes"]]
        self._seen_version, self._waiting = None, False
        if getattr(self.link.averager, "setting", row) != row:
            switch_codec(self.link, self.engine, self.codec, setting)
        self.link.auto_choice = self.choice
        _show(self.link, self.choice, self.decided_bytes_per_s, -1)
        self._show_changes()

    def period(self, step: int, lr: float) -> int:
        self._redecide(step)
        if self.choice.setting.schedule == "paced":
            return self._paced(self.h).period(step, lr)
        return fixed_period(step, h=self.h, total_steps=self.total_steps, h_max=self.h_max)

    def _paced(self, h: int) -> PacedSchedule:
        """The run's paced plan at mean period ``h`` (the base's, or the base's at another H)."""
        if not isinstance(self.base, PacedSchedule):
            raise TypeError(f"a paced setting needs the run's paced schedule; this run's is {type(self.base).__name__}")
        return self.base if self.base.h == h else dataclasses.replace(self.base, h=h)

    def _redecide(self, step: int) -> None:
        current = getattr(self.link.averager, "_table", None)  # (block, version, table) of the exchange just launched
        if self._waiting or current is None or current[1] == self._seen_version:
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
        choice = auto_choice.choose_relink(self.table, self.choice.setting, num_params=self.num_params,
                                           link_bytes_per_s=now, step_s=self.step_s, groups=self.groups,
                                           codec_fixed=self.codec_fixed, h_fixed=self.h_fixed)
        old = self.choice.setting
        self.choice = choice
        new = choice.setting
        self.link.averager.setting = new.row  # what the next exchanges ask their quorums with
        link_text = f"the slowest link moved to {8 * now / 1e6:.3g} Mbit/s (plan version {current[1]})"
        if new.codec_options != old.codec_options:
            switch_codec(self.link, self.engine, self.codec, new)
            self.codec_changes.append((step, new.label, now))
            log.warning("auto: %s: %s -> %s from the next exchange (step %d): %s", link_text, old.label, new.label,
                        step, choice.reason)
        elif new.h != old.h:
            log.warning("auto: %s: H %d -> %d from step %d: %s", link_text, old.h, new.h, step, choice.reason)
        else:
            log.info("auto: %s: %s stays: %s", link_text, old.label, choice.reason)
        if new.h != old.h:
            self.changes.append((step, new.h, now))
        _show(self.link, choice, now, current[1])
        self._show_changes()

    def _show_changes(self) -> None:
        self.link.auto["h_changes"] = [{"step": st, "h": h, "link_bytes_per_s": bw} for st, h, bw in self.changes]
        self.link.auto["codec_changes"] = [{"step": st, "setting": label, "link_bytes_per_s": bw}
                                           for st, label, bw in self.codec_changes]


def switch_codec(link: Any, engine: Any, base: CodecSpec, setting: auto_choice.Setting) -> None:
    """Run ``setting``'s codec (the job's codec options ``base`` with those the setting sets) from the
    next exchange on: the averager's codec, and the engine's residuals where error feedback starts
    or stops (``engine`` None: before the engine exists)."""
    codec = setting.codec_spec(base).build()
    link.averager.set_codec(codec)
    link.averager.setting = setting.row
    if engine is not None:
        engine.set_error_feedback(bool(getattr(codec, "requires_error_feedback", False)))


def _show(link: Any, choice: Choice, bandwidth: float, version: int) -> None:
    """The choice in the link's summary/progress fields and in the metrics."""
    link.auto = {**(link.auto or {}), "row": choice.setting.row, "setting": choice.setting.label,
                 "reason": choice.reason, "hides": choice.hides, "wire_s": choice.wire_s, "budget_s": choice.budget_s,
                 "link_bytes_per_s": bandwidth, "plan_version": version, "short": choice.short}
    link.metrics.auto_decided({"row": choice.setting.row, "setting": choice.setting.label, "codec": choice.setting.codec,
                               "h": str(choice.setting.h), "mode": choice.setting.mode, "hides": str(choice.hides).lower(),
                               "reason": choice.reason})


def install_auto_schedule(engine: Any, link: Any, codec: CodecSpec) -> AutoSchedule | None:
    """With ``--h auto`` and/or ``--codec auto`` (as given, before the choice): what was left to
    auto follows the link for the rest of the run. ``codec``: the codec options the job runs (chosen)."""
    inputs = getattr(link, "auto_inputs", None)
    if inputs is None or not hasattr(engine, "schedule"):
        return None
    schedule = AutoSchedule(engine.schedule, link, link.auto_choice, inputs["table"], num_params=inputs["num_params"],
                            step_s=inputs["step_s"], groups=inputs["groups"], engine=engine, codec=codec,
                            codec_fixed=inputs["codec"] is not None, h_fixed=inputs["h"] is not None)
    engine.schedule = schedule
    link.auto_schedule = schedule
    return schedule
