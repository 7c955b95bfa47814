"""``--codec auto`` and ``--h auto``: the setting a job runs, chosen from the measured link and the
measured inner step, among the settings the convergence study measured (issue 31, point 4).

The table (``auto_table.json`` beside this file, written by ``python bench/auto_table.py`` from
``bench/results/convergence.json``) holds only settings the study ran at its long size, each a
full setting (codec with its block size, top-k density and zstd stage, the last exchange's codec,
outer rule with its lr/momentum and residual decay, H and its schedule, fixed or paced, mode,
fragments, tau, overlap's merge alpha) with its loss cost against fp32 DiLoCo and the bits all
groups sent per parameter per inner step. Under ``paced`` H is the mean period (the same syncs as
fixed H, so the same bytes per exchange and the same share of a round's compute on average).

The rule (``choose``, pure): an exchange *fits* when its time on the slowest group-to-group link
is at most the compute it runs beside: a whole round of H inner steps where the exchange overlaps
the next round (eager, delayed), tau steps per fragment (overlap); a blocking exchange overlaps
nothing, so it fits when it takes at most ``BLOCKING_SHARE`` of its round's compute (5 %: the
issue's 95 % compute utilization). Among the settings that fit, the lowest measured loss cost; if
none fits, the fewest bits per parameter per inner step, and the reason says the exchange will
not hide.
A fixed ``--codec`` or ``--h`` narrows the candidates to the study's settings with that codec or H.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from compress import codec_spec
from compress.codec_spec import AUTO, CodecSpec

AUTO_H = AUTO  # ``sync.h`` of ``--h auto``: the string "auto", as flags and files spell it
TABLE_PATH = Path(__file__).with_name("auto_table.json")
#: a link re-measured this much faster or slower (relative) than the one decided on is a changed link
RELINK_THRESHOLD = 0.3
#: the share of a round's compute a blocking exchange may add to it and still count as hidden
BLOCKING_SHARE = 0.05

# the options a table entry sets: (config section, key, default, flag, the Setting field it comes from);
# they must be left at their defaults when auto decides; ``None``: auto leaves it at its default
_CHOSEN = (("sync", "mode", "blocking", "--mode", "mode"), ("sync", "fragments", 1, "--fragments", "fragments"),
           ("sync", "overlap_steps", 1, "--overlap-steps", "overlap_steps"),
           ("sync", "schedule", "fixed", "--schedule", "schedule"), ("sync", "h_max", 0, "--h-max", None),
           ("outer", "optimizer", "nesterov", "--outer-optimizer", "outer_optimizer"),
           ("outer", "lr", -1.0, "--outer-lr", "outer_lr"), ("outer", "momentum", -1.0, "--outer-momentum", "outer_momentum"),
           ("outer", "sparseloco_beta", 0.95, "--sparseloco-beta", "sparseloco_beta"),
           ("sync", "round_seconds", 0.0, "--round-seconds", None),
           ("sync", "paced_gamma", 0.5, "--paced-gamma", "paced_gamma"),
           ("outer", "residual_decay", 1.0, "--residual-decay", "residual_decay"),
           ("outer", "alpha", -1.0, "--merge-alpha", "merge_alpha"),
           # the codec's options, as its spec says auto treats them (compress.codec_spec)
           *(("transport", f.name, f.default, f.metadata["flag"],
              "codec_options" if f.metadata["auto"] == codec_spec.AUTO_SETS else None)
             for f in codec_spec.codec_options() if f.name != "codec" and f.metadata["auto"] != codec_spec.AUTO_KEEPS))

#: the codec options a setting holds (``Setting.codec_options``; a flat key each in the table)
CODEC_OPTIONS_SET = tuple(f for f in codec_spec.codec_options() if f.metadata["auto"] == codec_spec.AUTO_SETS)


@dataclass(frozen=True)
class Setting:
    """One setting the study measured: what a job runs, its loss cost and its traffic. Its codec is
    ``codec_options``: the options ``CODEC_OPTIONS_SET`` names as the study set them (a table
    written before an option was measured reads as its default), the others at their defaults."""

    row: str
    codec_options: CodecSpec
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    sparseloco_beta: float | None
    h: int
    mode: str
    fragments: int
    overlap_steps: int
    groups: int
    seeds: tuple[int, ...]
    eval_loss: float
    loss_cost: float  # eval loss / fp32 DiLoCo's at H=30 - 1 (the study's, paired by seed)
    bits_per_param_per_step: float  # all groups together
    # (defaults: what a table written before these fields were measured ran)
    schedule: str = "fixed"  # or "paced": h is then the mean period
    paced_gamma: float = 0.5
    residual_decay: float = 1.0
    merge_alpha: float = -1.0  # -1: the mode's (0.5 in overlap)

    @property
    def codec(self) -> str:
        return self.codec_options.codec

    def codec_spec(self, base: CodecSpec) -> CodecSpec:
        """The codec this setting runs: the job's codec options ``base`` with those the study set."""
        return dataclasses.replace(base, **{f.name: getattr(self.codec_options, f.name) for f in CODEC_OPTIONS_SET})

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> "Setting":
        """A setting from a table entry (flat keys: the codec options' beside the others)."""
        names = {f.name for f in fields(cls)}
        codec = CodecSpec(**{f.name: entry[f.name] for f in CODEC_OPTIONS_SET if f.name in entry})
        return cls(**{**{k: v for k, v in entry.items() if k in names}, "codec_options": codec,
                      "seeds": tuple(entry["seeds"])})

    def to_json(self) -> dict[str, Any]:
        """The table entry of this setting: flat keys, the codec options' in place of ``codec_options``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "codec_options":
                out.update({o.name: getattr(self.codec_options, o.name) for o in CODEC_OPTIONS_SET})
            else:
                out[f.name] = list(self.seeds) if f.name == "seeds" else getattr(self, f.name)
        return out

    @property
    def label(self) -> str:
        """``topk 1.56 % sparseloco H=30``, ``int4 H=200``, ``fp32 overlap P=2 tau=5 H=30``,
        ``int2 b1024 zstd decay 0 then int4 paced 0.5 H=200`` ..."""
        c = self.codec_options
        parts = [c.codec + (f" {100 * c.topk_density:.3g} %" if c.codec == "topk" else "")]
        parts += [f"b{c.codec_block}"] if c.codec_block else []
        parts += ["zstd"] if c.zstd else []
        parts += [f"decay {self.residual_decay:g}"] if self.residual_decay != 1.0 else []
        parts += [f"then {c.final_codec}"] if c.final_codec else []
        if self.outer_optimizer != "nesterov":
            parts.append(self.outer_optimizer)
        if self.mode != "blocking":
            parts.append(self.mode + (f" P={self.fragments} tau={self.overlap_steps}" if self.mode == "overlap" else ""))
        parts += [f"alpha {self.merge_alpha:g}"] if self.merge_alpha >= 0 else []
        parts += [f"paced {self.paced_gamma:g}"] if self.schedule == "paced" else []
        return " ".join(parts + [f"H={self.h}"])


@dataclass(frozen=True)
class AutoTable:
    """The study's settings and where they come from."""

    size: str
    study_dates: tuple[str, ...]
    commit: str
    regenerate: str
    entries: tuple[Setting, ...]

    def groups_measured(self, groups: int) -> int:
        """The group count of the study closest to ``groups`` (the smaller on a tie)."""
        counts = sorted({e.groups for e in self.entries})
        if not counts:
            raise ValueError("the auto table has no settings")
        return min(counts, key=lambda g: (abs(g - groups), g))

    def named(self, row: str) -> Setting | None:
        """The setting of row ``row`` (None: the table has none)."""
        return next((e for e in self.entries if e.row == row), None)

    def candidates(self, groups: int, codec: str | None = None, h: int | None = None) -> list[Setting]:
        """The settings measured at the group count closest to ``groups``, with ``codec`` and ``h``
        where they are fixed (None: any)."""
        g = self.groups_measured(groups)
        return [e for e in self.entries if e.groups == g and codec in (None, e.codec) and h in (None, e.h)]


def load_table(path: str | Path = TABLE_PATH) -> AutoTable:
    """Read a table written by ``bench/auto_table.py`` (ValueError when it is not one)."""
    try:
        raw = json.loads(Path(path).read_text())
        entries = tuple(Setting.from_json(e) for e in raw["entries"])
        return AutoTable(raw["size"], tuple(raw["study_dates"]), raw["commit"], raw["regenerate"], entries)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the auto table {path}: {e}") from e


@dataclass(frozen=True)
class Choice:
    """What ``choose`` decided and the numbers it decided from."""

    setting: Setting
    wire_s: float  # seconds one exchange (of one fragment) takes on the slowest link
    budget_s: float  # seconds of compute it may hide under
    hides: bool
    link_bytes_per_s: float
    step_s: float
    reason: str

    @property
    def short(self) -> str:
        """The choice in one line of at most 256 characters (``diloco status``)."""
        how = "hides under compute" if self.hides else "does NOT hide"
        return (f"{self.setting.label}: {self.wire_s:.3g} s wire / {self.budget_s:.3g} s budget at "
                f"{8 * self.link_bytes_per_s / 1e6:.3g} Mbit/s, {how}; loss {100 * self.setting.loss_cost:+.2f} % "
                f"vs fp32 DiLoCo (study)")[:256]


def wire_seconds(s: Setting, num_params: int, link_bytes_per_s: float) -> float:
    """Seconds one exchange of ``s`` (of one fragment, in overlap) takes when each group's share of
    the study's traffic crosses a link of ``link_bytes_per_s``."""
    per_group_bits = s.bits_per_param_per_step / s.groups * s.h * num_params
    return per_group_bits / 8.0 / link_bytes_per_s / s.fragments


def budget_seconds(s: Setting, step_s: float, blocking_share: float = BLOCKING_SHARE) -> float:
    """Seconds an exchange of ``s`` may take and count as hidden: tau inner steps per fragment in
    overlap, a round of H in eager and delayed (the next round runs beside it), ``blocking_share``
    of a round in blocking (which waits for it)."""
    if s.mode == "overlap":
        return s.overlap_steps * step_s
    return s.h * step_s * (blocking_share if s.mode == "blocking" else 1.0)


def choose(table: AutoTable, *, num_params: int, link_bytes_per_s: float, step_s: float, groups: int,
           codec: str | None = None, h: int | None = None, blocking_share: float = BLOCKING_SHARE) -> Choice:
    """The setting to run (see the module doc). ``num_params``: parameters exchanged;
    ``link_bytes_per_s``: the slowest group-to-group link; ``step_s``: seconds per inner step
    (the slowest group's); ``codec``/``h``: fixed by the user (None: chosen)."""
    if num_params < 1 or not link_bytes_per_s > 0 or not step_s > 0 or groups < 2:
        raise ValueError(f"auto needs parameters >= 1, a measured link > 0 B/s, an inner step > 0 s and >= 2 groups; "
                         f"got {num_params}, {link_bytes_per_s}, {step_s}, {groups}")
    pool = table.candidates(groups, codec, h)
    if not pool:
        raise ValueError(f"the study ({table.size}) measured no setting with "
                         f"{'codec ' + codec if codec else 'any codec'} at {'H=' + str(h) if h else 'any H'}")
    timed = [(e, wire_seconds(e, num_params, link_bytes_per_s), budget_seconds(e, step_s, blocking_share))
             for e in pool]
    fit = [t for t in timed if t[1] <= t[2]]
    measured = table.groups_measured(groups)
    where = f"study {table.size}, {measured} groups" + (f"; this job has {groups}" if measured != groups else "")
    if fit:
        e, wire, budget = min(fit, key=lambda t: (t[0].loss_cost, t[0].bits_per_param_per_step, t[0].row))
        verdict = (f"hides under compute; the lowest measured loss cost of the {len(fit)} of {len(pool)} settings "
                   f"that fit")
    else:
        e, wire, budget = min(timed, key=lambda t: (t[0].bits_per_param_per_step, t[0].loss_cost, t[0].row))
        verdict = f"none of the {len(pool)} settings fits: the fewest bits, the exchange will not hide"
    reason = (f"{e.label}: {e.bits_per_param_per_step:.3g} bits/param/step, {wire:.3g} s on the wire per exchange "
              f"against a budget of {budget:.3g} s ({_budget_rule(e, blocking_share)}; link {8 * link_bytes_per_s / 1e6:.3g} Mbit/s, "
              f"{1e3 * step_s:.3g} ms/step, {num_params:,} params); {verdict}; loss {100 * e.loss_cost:+.2f} % vs "
              f"fp32 DiLoCo H=30 ({where})")
    return Choice(e, wire, budget, bool(fit), link_bytes_per_s, step_s, reason)


def _budget_rule(s: Setting, blocking_share: float) -> str:
    if s.mode == "overlap":
        return f"tau={s.overlap_steps} steps"
    return f"{100 * blocking_share:g} % of H={s.h} steps" if s.mode == "blocking" else f"H={s.h} steps"


def slowest_link(table: Mapping[int, Mapping[int, Mapping[int, float]]], sizes: Mapping[int, int]) -> float:
    """Bytes/s of the slowest group-to-group link in a coordinator bandwidth table (group -> rank ->
    peer group -> bytes/s): a group's capacity towards a peer is the sum of its ranks' rates
    (its stripes run on all of them at once). ValueError while a rank has not reported."""
    groups = sorted(sizes)
    rates = []
    for g in groups:
        ranks = table.get(g, {})
        if len(ranks) != sizes[g]:
            raise ValueError(f"group {g}: {len(ranks)} of {sizes[g]} ranks measured their links")
        for peer in groups:
            if peer != g:
                rates.append(sum(float(ranks[r].get(peer, 0.0)) for r in ranks))
    if not rates or min(rates) <= 0:
        raise ValueError(f"no measured link between the groups: {dict(table)}")
    return min(rates)


#: what a running job keeps when it follows its link: the outer rule and its state, the sync mode,
#: its fragments and schedule, the last exchange's codec (the codec with its options and H may
#: change between two launches)
_RULE = ("outer_optimizer", "outer_lr", "outer_momentum", "sparseloco_beta", "mode", "fragments", "overlap_steps",
         "groups", "schedule", "paced_gamma", "residual_decay", "merge_alpha")


def same_rule(a: Setting, b: Setting) -> bool:
    """Whether a running job can switch between ``a`` and ``b``: the same outer rule (and lr,
    momentum, residual decay), mode, fragments, tau, schedule and last exchange's codec (the
    engine holds them from its start); codec, its block and zstd, density and H may differ."""
    return all(getattr(a, k) == getattr(b, k) for k in _RULE) and \
        a.codec_options.final_codec == b.codec_options.final_codec


def same_but_h(a: Setting, b: Setting) -> bool:
    """Whether ``a`` and ``b`` are one setting at two values of H (codec, block, zstd and density
    kept too)."""
    return same_rule(a, b) and a.codec_options == b.codec_options


def choose_relink(table: AutoTable, current: Setting, *, num_params: int, link_bytes_per_s: float, step_s: float,
                  groups: int, codec_fixed: bool = False, h_fixed: bool = False,
                  blocking_share: float = BLOCKING_SHARE) -> Choice:
    """``choose`` among the settings a running job on ``current`` can switch to when its link
    changed (``same_rule``), keeping the codec and density (``codec_fixed``: a fixed ``--codec``)
    or H (``h_fixed``: a fixed ``--h``) where the user fixed them."""
    pool = tuple(e for e in table.entries if same_rule(e, current)
                 and (not codec_fixed or e.codec_options == current.codec_options)
                 and (not h_fixed or e.h == current.h))
    sub = AutoTable(table.size, table.study_dates, table.commit, table.regenerate, pool)
    return choose(sub, num_params=num_params, link_bytes_per_s=link_bytes_per_s, step_s=step_s, groups=groups,
                  blocking_share=blocking_share)


def choose_h(table: AutoTable, current: Setting, *, num_params: int, link_bytes_per_s: float, step_s: float,
             groups: int, blocking_share: float = BLOCKING_SHARE) -> Choice:
    """``choose`` among the table's settings that differ from ``current`` in H only: the H a
    running job moves to when its link changed (the same rule, the codec kept)."""
    return choose_relink(table, current, num_params=num_params, link_bytes_per_s=link_bytes_per_s, step_s=step_s,
                         groups=groups, codec_fixed=True, blocking_share=blocking_share)


def link_changed(decided_bytes_per_s: float, measured_bytes_per_s: float,
                 threshold: float = RELINK_THRESHOLD) -> bool:
    """Whether a re-measured link differs enough from the one decided on to decide again: by more
    than ``threshold`` relative either way (the hysteresis that keeps a noisy probe from flapping)."""
    return abs(measured_bytes_per_s - decided_bytes_per_s) > threshold * decided_bytes_per_s


def running_setting(table: AutoTable, row: str, *, codec: str | None = None, h: int | None = None) -> Setting:
    """The table's setting named ``row`` (the one a running job or a checkpoint runs), with the
    ``codec`` and ``h`` the user fixed (None: auto); ValueError when this table lacks it or the
    flags exclude it."""
    setting = table.named(row)
    if setting is None:
        raise ValueError(f"the job runs the auto setting {row!r}, which this auto table ({table.size}, {table.commit}) "
                         "does not hold (or this config cannot run): start every group with the same version and flags")
    if codec not in (None, setting.codec) or h not in (None, setting.h):
        raise ValueError(f"the job runs {setting.label} (auto setting {row!r}), which these flags exclude "
                         f"(--codec {codec or 'auto'}, --h {h or 'auto'})")
    return setting


def is_auto(cfg: Any) -> tuple[bool, bool]:
    """(codec auto, H auto) of a ``Config``."""
    return cfg.transport.codec == AUTO, cfg.sync.h == AUTO_H


def auto_problems(cfg: Any, table: AutoTable | None = None) -> list[str]:
    """What in ``cfg`` (a ``Config``) keeps ``--codec auto`` / ``--h auto`` from deciding: empty when
    it can (or neither is asked for)."""
    codec_auto, h_auto = is_auto(cfg)
    if not (codec_auto or h_auto):
        return []
    asked = " and ".join(x for x, on in (("--codec auto", codec_auto), ("--h auto", h_auto)) if on)
    problems = []
    if cfg.transport.probe_bytes <= 0:
        problems.append(f"{asked} decides from the measured link: --probe-bytes must be > 0")
    if cfg.topology.groups < 2:
        problems.append(f"{asked} decides from the link between groups: --groups must be >= 2")
    given = [f"{flag} {getattr(getattr(cfg, sec), name)}" for sec, name, default, flag, _ in _CHOSEN
             if getattr(getattr(cfg, sec), name, default) != default]
    if given:
        problems.append(f"{asked} takes mode, fragments, tau, outer rule and top-k density from the study's setting; "
                        f"leave them unset (got {', '.join(given)})")
    try:
        t = table if table is not None else load_table()
        if not t.candidates(cfg.topology.groups, None if codec_auto else cfg.transport.codec,
                            None if h_auto else cfg.sync.h):
            problems.append(f"{asked}: the study ({t.size}) measured no setting with "
                            f"{'any codec' if codec_auto else '--codec ' + cfg.transport.codec} at "
                            f"{'any H' if h_auto else 'H=' + str(cfg.sync.h)}; measured: "
                            f"{', '.join(sorted({e.label for e in t.entries}))}")
    except ValueError as e:
        problems.append(str(e))
    return problems


def unchoose(cfg: Any, *, codec: bool, h: bool) -> Any:
    """A copy of ``cfg`` (a ``Config`` that ran a setting, e.g. a checkpoint's) with ``--codec auto``
    (``codec``) and/or ``--h auto`` (``h``) asked again and the options a setting sets at their
    defaults: what the job's flags were."""
    out = copy.deepcopy(cfg)
    for section, name, default, _, _ in _CHOSEN:
        setattr(getattr(out, section), name, default)
    if codec:
        out.transport.codec = AUTO
    if h:
        out.sync.h = AUTO_H
    return out


def apply_choice(cfg: Any, s: Setting) -> Any:
    """A copy of ``cfg`` (a ``Config``) that runs setting ``s``."""
    out = copy.deepcopy(cfg)
    for section, name, _, _, field in _CHOSEN:
        if section == "transport":  # the codec's options: below, from the setting's codec
            continue
        value = None if field is None else getattr(s, field)
        if value is not None:  # a table without a beta: the config's
            setattr(getattr(out, section), name, value)
    for option in CODEC_OPTIONS_SET:
        setattr(out.transport, option.name, getattr(s.codec_options, option.name))
    out.sync.h = s.h
    return out
