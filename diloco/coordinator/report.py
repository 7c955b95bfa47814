"""The job's summary, built from the summaries the groups reported (torch-free, pure).

Every key of a group's summary is optional and untrusted: a missing key leaves that figure out
(``None``), a value of the wrong type is left out too and named in ``notes``. Nothing is guessed.
"""

from __future__ import annotations

import math

from collections.abc import Collection
from typing import Any

from .rounds import LATE, summary_kind

MAX_SHOWN_CHARS = 80  # longest untrusted value quoted in notes and problems


def job_summary(summaries: dict[int, dict[str, Any]],
                joined_late: Collection[int] = ()) -> dict[str, Any]:
    """The job's summary from ``{group: summary}`` (JSON-able; group ids are int keys).

    ``joined_late``: the groups the coordinator told that the job had finished before they could
    heal. A summary saying ``joined_late`` holds no model: such a group is left out of every figure
    below (listed under late_groups with its reason); one the coordinator did not tell so is a
    problem too, since nothing but its own word says it holds no diverged model.

    Keys: groups (count of summaries), group_ids, model_group_ids (the groups that trained to the
    end: every figure is theirs), late_groups ({group: reason}), eval_loss (lowest model group's,
    e.g. group 0's: the global model), eval_loss_mean, eval_loss_per_group, initial_eval_loss,
    outer_rounds, inner_steps, num_parameters, mode, fragments (each the lowest model group's value;
    ``<key>_per_group`` too), tokens (sum), bytes_sent / bytes_received (sums over groups, bytes),
    param_hash_per_group, params_identical (True, False, or None when a group sent no hash or
    none trained to the end), seconds (wall, slowest group), utilization (lowest), failed_groups,
    problems (why the job did not end cleanly: diverged or missing hashes, failed groups, no group
    that trained to the end, an unconfirmed late join), ok (no problems), notes (values left out).
    """
    if not summaries:
        raise ValueError("no group summaries to summarize")
    late = {g: _shown(s.get("reason", "")) for g, s in sorted(summaries.items()) if summary_kind(s) == LATE}
    groups = [g for g in sorted(summaries) if g not in late]
    trained = {g: summaries[g] for g in groups}
    notes: list[str] = []
    losses = _numbers(trained, "eval_loss", notes)
    hashes = _hashes(trained, notes)
    first = groups[0] if groups else None
    job: dict[str, Any] = {
        "groups": len(summaries),
        "group_ids": sorted(summaries),
        "model_group_ids": groups,
        "late_groups": late,
        "eval_loss": losses.get(first),
        "eval_loss_mean": _mean(losses),
        "eval_loss_per_group": _all_groups(groups, losses),
        "initial_eval_loss": _initial_eval_loss(_numbers(trained, "initial_eval_loss", notes), first),
    }
    for key, kind in (("outer_rounds", int), ("inner_steps", int), ("num_parameters", int),
                      ("mode", str), ("fragments", int)):
        per_group = _typed(trained, key, kind, notes)
        job[key] = per_group.get(first)
        job[f"{key}_per_group"] = _all_groups(groups, per_group)
    job["tokens"] = _sum(_typed(trained, "tokens", int, notes))
    job["bytes_sent"] = _sum(_typed(trained, "bytes_sent", int, notes))
    job["bytes_received"] = _sum(_typed(trained, "bytes_received", int, notes))
    job["param_hash_per_group"] = _all_groups(groups, hashes)
    job["params_identical"] = _identical(groups, hashes) if groups else None
    seconds = _numbers(trained, "seconds", notes)
    job["seconds"] = max(seconds.values()) if seconds else None
    utilization = _numbers(trained, "utilization", notes)
    job["utilization"] = min(utilization.values()) if utilization else None
    job["failed_groups"] = [g for g in groups if trained[g].get("failed")]
    job["problems"] = _problems(job, trained, unconfirmed=sorted(set(late) - set(joined_late)))
    job["ok"] = not job["problems"]
    job["notes"] = notes
    return job


def format_job_summary(job: dict[str, Any]) -> str:
    """Human-readable block for a :func:`job_summary` dict (losses in nats/token)."""
    groups = job["model_group_ids"]
    per_loss = ", ".join(_num(job["eval_loss_per_group"][g], ".4f") for g in groups)
    lines = [
        "diloco job summary",
        f"  eval loss (global model) : {_num(job['eval_loss'], '.4f')} nats/token "
        f"(initial {_num(job['initial_eval_loss'], '.4f')})",
        f"  eval loss per group      : {per_loss} (mean {_num(job['eval_loss_mean'], '.4f')})",
        f"  sync mode                : {_agreed(job, 'mode')}, "
        f"{_agreed(job, 'fragments')} fragment(s)",
        f"  outer rounds             : {_agreed(job, 'outer_rounds')}",
        f"  inner steps per rank     : {_agreed(job, 'inner_steps')}",
        f"  groups                   : {job['groups']} ({', '.join(map(str, job['group_ids']))})",
        f"  parameters               : {_agreed(job, 'num_parameters', ',')}",
        f"  tokens                   : {_num(job['tokens'], ',')}",
        f"  bytes between groups     : {_bytes(job['bytes_sent'])} sent, "
        f"{_bytes(job['bytes_received'])} received",
        f"  global params identical  : {_identical_text(job)} "
        f"({', '.join(str(job['param_hash_per_group'][g]) for g in groups)})",
        f"  compute utilization      : {_percent(job['utilization'])} (slowest group)",
        f"  wall time                : {_num(job['seconds'], '.1f')} s (slowest group)",
    ]
    for g, reason in job["late_groups"].items():
        lines.append(f"  joined too late          : group {g} ({reason}): it holds no model; left out of "
                     "the figures above")
    if job["failed_groups"]:
        lines.append(f"  failed groups            : {', '.join(map(str, job['failed_groups']))}")
    lines += [f"  note: {n}" for n in job["notes"]]
    return "\n".join(lines)


# --- reading untrusted summaries ----------------------------------------------------------------

def _typed(summaries: dict[int, dict[str, Any]], key: str, kind: type,
           notes: list[str]) -> dict[int, Any]:
    """``{group: value}`` of the groups whose ``key`` is a ``kind`` (bool is no int); a present
    value of another type is left out and noted."""
    out: dict[int, Any] = {}
    for g in sorted(summaries):
        if key not in summaries[g]:
            continue
        value = summaries[g][key]
        if isinstance(value, kind) and not isinstance(value, bool):
            out[g] = value
        else:
            notes.append(f"group {g}: {key} {_shown(value)} is not of type {kind.__name__}; left out")
    return out


def _initial_eval_loss(per_group: dict[int, float], first: int | None) -> float | None:
    """The job's initial eval loss: the lowest group's, or, when that group healed into the job
    (it measured none: NaN), the lowest group's that did."""
    value = per_group.get(first) if first is not None else None
    if value is not None and math.isfinite(value):
        return value
    measured = [v for _, v in sorted(per_group.items()) if math.isfinite(v)]
    return measured[0] if measured else value


def _numbers(summaries: dict[int, dict[str, Any]], key: str,
             notes: list[str]) -> dict[int, float]:
    """Like :func:`_typed` for int-or-float values, as floats (NaN kept: a diverged loss)."""
    out: dict[int, float] = {}
    for g in sorted(summaries):
        if key not in summaries[g]:
            continue
        value = summaries[g][key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[g] = float(value)
        else:
            notes.append(f"group {g}: {key} {_shown(value)} is not a number; left out")
    return out


def _hashes(summaries: dict[int, dict[str, Any]], notes: list[str]) -> dict[int, str]:
    """``{group: param_hash}`` of the groups that sent a non-empty string."""
    hashes = _typed(summaries, "param_hash", str, notes)
    for g in [g for g, h in hashes.items() if not h]:
        notes.append(f"group {g}: param_hash is empty; left out")
        del hashes[g]
    return hashes


def _all_groups(groups: list[int], values: dict[int, Any]) -> dict[int, Any]:
    return {g: values.get(g) for g in groups}


def _mean(values: dict[int, float]) -> float | None:
    return sum(values.values()) / len(values) if values else None


def _sum(values: dict[int, int]) -> int | None:
    return sum(values.values()) if values else None


def _identical(groups: list[int], hashes: dict[int, str]) -> bool | None:
    """True if every group sent the same hash, False if two differ, None if one is missing."""
    if len(set(hashes.values())) > 1:
        return False
    return True if len(hashes) == len(groups) else None


def _problems(job: dict[str, Any], summaries: dict[int, dict[str, Any]], *,
              unconfirmed: list[int]) -> list[str]:
    """Why the job did not end cleanly, one sentence each (``summaries``: the model groups')."""
    problems = []
    hashes = job["param_hash_per_group"]
    listed = ", ".join(f"group {g} {h}" for g, h in hashes.items())
    if not hashes:
        problems.append(f"no group trained to the end: every group joined too late "
                        f"({sorted(job['late_groups'])})")
    elif job["params_identical"] is False:
        problems.append(f"the groups' global parameters diverged: {listed}")
    elif job["params_identical"] is None:
        silent = [g for g, h in hashes.items() if h is None]
        problems.append(f"cannot tell whether the global parameters are identical: no param_hash "
                        f"from groups {silent}")
    for g in job["failed_groups"]:
        problems.append(f"group {g} reported failure: {_shown(summaries[g]['failed'])}")
    for g in unconfirmed:
        problems.append(f"group {g} says it joined too late, but the coordinator never told it the job had "
                        "finished: whether it holds a model that differs is unknown")
    return problems


# --- formatting ---------------------------------------------------------------------------------

def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS - 3] + "..."


def _num(value: float | int | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _agreed(job: dict[str, Any], key: str, spec: str = "") -> str:
    """The job's value of ``key``, followed by every group's when the groups disagree."""
    per_group = job[f"{key}_per_group"]
    text = _num(job[key], spec)
    if len(set(per_group.values())) > 1:
        text += " (groups disagree: " + ", ".join(
            f"{g}: {_num(v, spec)}" for g, v in per_group.items()) + ")"
    return text


def _identical_text(job: dict[str, Any]) -> str:
    identical = job["params_identical"]
    if identical is None:
        return "unknown"
    return "True" if identical else "False, DIVERGED"


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.1f}%"


def _bytes(n: int | None) -> str:
    """``37.1MB (37,148,552 B)``: decimal units, then the exact count."""
    if n is None:
        return "n/a"
    value, unit = float(n), "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            break
        value /= 1000
    short = f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
    return f"{short} ({n:,} B)"
