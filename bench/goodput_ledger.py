"""The goodput ledger of ``bench/goodput.py``'s fault case: pure functions from a job's log lines,
kill times and step traces to the numbers it reports (records in, numbers out; no processes).

Goodput's numerator is the committed-sample ledger each group's rank 0 logs
(``diloco.exchange.data_positions``), each range once, timed by its first log line; ``CountError``
stops the bench where the numerator and the ledger disagree or a window holds more than its job
committed. ``bench/goodput_faults.py`` runs the jobs and calls these.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime, timezone

from diloco.exchange.data_positions import _ledger_record, _within, check_ledger, ledger_from_logs

_TEXT_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z ")

Commit = tuple[float, int, int, int]  # (unix time s, group, first, end)


class CountError(ValueError):
    """The goodput numerator does not agree with the job's committed-sample ledger (a commit
    counted twice, or one the ledger has and the numerator lacks)."""


def _line_time(line: str) -> float:
    """The unix time of a worker log line (text: its leading UTC stamp; JSON: its ``ts``)."""
    if line.lstrip().startswith("{"):
        stamp = str(json.loads(line).get("ts", ""))
    else:
        m = _TEXT_TIME.match(line)
        stamp = m.group(1) + "Z" if m else ""
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        raise CountError(f"a committed-data log line without a readable time: {line[:200]!r}") from None


def timed_ledger(lines: Iterable[str]) -> dict[int, list[tuple[float, int, int]]]:
    """``ledger_from_logs``'s ranges, each with the time of the line that first logged it:
    ``{group: [(unix time s, first, end), ...]}`` in the ledger's order. The same records
    (``data_positions._ledger_record``: rank 0's lines, text or JSON) under the same rule: a range
    logged again for the same exchange (a healer's ``log_inherited``, the group's last
    ``ADVANCES_KEPT`` advances) counts once, at its first line; a resume drops the ranges its group
    logged for rounds after the checkpoint's. ``commits_from_logs`` checks the two agree."""
    out: dict[int, dict[tuple, float]] = {}  # per group, key (as ledger_from_logs keys it) -> first time
    for n, line in enumerate(lines):
        record = _ledger_record(line)
        if record is None:
            continue
        group, first, end, tag, resume = record
        ranges = out.setdefault(group, {})
        if resume is not None:
            out[group] = {k: t for k, t in ranges.items() if k[2] is None or _within(k[2], resume)}
        else:
            key = (first, end, tag) if tag else (first, end, None, n)
            if key not in ranges:
                ranges[key] = _line_time(line)
    return {g: [(t, k[0], k[1]) for k, t in ranges.items()] for g, ranges in out.items()}


def commits_from_logs(lines: Iterable[str]) -> list[Commit]:
    """Every range the job committed, once, with its time: (unix time s, group, first, end) sorted
    by time, ``first``/``end`` in samples of the group's stream (half-open), from the worker log
    lines of every incarnation of every group (each group's lines in the order written). The
    ranges are exactly ``ledger_from_logs``' (``CountError`` if not): a range a healer logs again
    counts once, at the time it was first logged (if the process that saw it commit died before
    logging it, the healer's line is the first: the commit then counts from the heal)."""
    lines = list(lines)
    timed = timed_ledger(lines)
    ledger = ledger_from_logs(lines)
    for g in sorted(set(timed) | set(ledger)):
        mine = [(a, b) for _, a, b in timed.get(g, [])]
        if mine != [tuple(r) for r in ledger.get(g, [])]:
            raise CountError(f"group {g}: the timed ranges ({len(mine)}) are not the ledger's "
                             f"({len(ledger.get(g, []))}): ledger_from_logs' rule changed and timed_ledger "
                             "no longer follows it")
    return sorted((t, g, a, b) for g, ranges in timed.items() for t, a, b in ranges)


def check_numerator(commits: list[Commit], ranges: dict[int, list[tuple[int, int]]]) -> None:
    """``CountError`` unless, per group, the samples ``commits`` sum to are the ledger's
    (``ranges``: ``ledger_from_logs``; the samples ``check_ledger`` counts)."""
    summed: dict[int, int] = {}
    for _, g, a, b in commits:
        summed[g] = summed.get(g, 0) + (b - a)
    ledger = {g: c.counted for g, c in check_ledger(ranges).items()}
    bad = {g: (summed.get(g, 0), ledger.get(g, 0)) for g in set(summed) | set(ledger)
           if summed.get(g, 0) != ledger.get(g, 0)}
    if bad:
        raise CountError("the goodput numerator and the ledger disagree, group: (numerator, ledger) samples "
                         + ", ".join(f"{g}: {v}" for g, v in sorted(bad.items())))


def check_in_window(name: str, commits: list[Commit], window: tuple[float, float], committed_tokens: int,
                    tokens_per_sample: int) -> int:
    """The tokens ``commits`` hold in ``window``; ``CountError`` if more than the ``committed_tokens``
    of the whole job (the ledger's): a window cannot hold more than everything committed."""
    tokens = committed_between(commits, *window) * tokens_per_sample
    if tokens > committed_tokens:
        raise CountError(f"{name} job: {tokens:,} tokens committed in the window ({window[1] - window[0]:.1f} s) "
                         f"exceed the {committed_tokens:,} the job committed in all: some commit is counted twice")
    return tokens


def committed_between(commits: list[Commit], t0: float, t1: float) -> int:
    """Samples committed in ``(t0, t1]`` (every group, every incarnation)."""
    return sum(end - first for t, _, first, end in commits if t0 < t <= t1)


def common_window(jobs: dict[str, list[Commit]]) -> tuple[float, float]:
    """The window every job was committing in: from the latest first commit to the earliest last
    commit (seconds, unix). ValueError when a job committed nothing or the windows do not overlap."""
    if not jobs or any(not c for c in jobs.values()):
        raise ValueError("a job committed nothing: no window to count goodput in")
    t0, t1 = max(c[0][0] for c in jobs.values()), min(c[-1][0] for c in jobs.values())
    if t1 <= t0:
        raise ValueError(f"the jobs' commit windows do not overlap ({t0:.1f} .. {t1:.1f})")
    return t0, t1


def downtimes(kills: list[tuple[float, int]], traces: dict[int, list[float]], settle_s: float = 0.5) -> list[float]:
    """Per kill (unix time s, group, as the drill decided it): seconds from the killed group's last
    training step before the kill to its first after it (its restart, rejoin and heal). The dying
    process may still start a step between the decision and the signal: steps within ``settle_s``
    after ``t`` do not count as after it. A kill with no step on either side in the trace is left
    out (the list is then shorter than the kills)."""
    out = []
    for t, g in kills:
        steps = traces.get(g, [])
        before = [s for s in steps if s <= t]
        after = [s for s in steps if s > t + settle_s]
        if before and after:
            out.append(after[0] - before[-1])
    return out


def recoveries(faults: list[tuple[float, int]], commits: list[Commit], settle_s: float = 0.5) -> list[float]:
    """Per fault (unix time s, group): seconds from the fault to the group's first range committed
    after it (``commits``: ``commits_from_logs``), i.e. until it adds to the job again. Unlike
    ``downtimes`` this covers what follows a freeze: the step the group runs when it wakes, being
    declared failed, its heal, its first round. A commit logged within ``settle_s`` after ``t``
    (the round the fault's victim had finished) does not count. A fault with no commit of its
    group after it is left out (the list is then shorter than the faults)."""
    out = []
    for t, g in faults:
        after = [c[0] for c in commits if c[1] == g and c[0] > t + settle_s]
        if after:
            out.append(min(after) - t)
    return out


def ledger_counts(ranges: dict[int, list[tuple[int, int]]]) -> dict[str, int]:
    """Samples committed, counted twice and left out over every group (``check_ledger``)."""
    checks = check_ledger(ranges).values()
    return {"committed": sum(c.counted for c in checks), "twice": sum(b - a for c in checks for a, b in c.twice),
            "left_out": sum(b - a for c in checks for a, b in c.gaps)}


def pair_result(fault: dict, free: dict, *, together: bool, tokens_per_sample: int) -> dict:
    """Goodput of a faulty job against its fault-free twin. ``fault``/``free``: records with
    ``commits`` (``commits_from_logs``), ``eval_loss`` and ``committed_tokens`` (the ledger's);
    ``CountError`` if a job's window holds more tokens than the job committed."""
    if together:
        wf = wr = common_window({"fault": fault["commits"], "free": free["commits"]})
    else:
        wf, wr = common_window({"f": fault["commits"]}), common_window({"f": free["commits"]})
    in_fault = check_in_window("the faulty", fault["commits"], wf, fault["committed_tokens"], tokens_per_sample)
    in_free = check_in_window("the fault-free", free["commits"], wr, free["committed_tokens"], tokens_per_sample)
    r_fault, r_free = in_fault / (wf[1] - wf[0]), in_free / (wr[1] - wr[0])
    return {"goodput": r_fault / r_free, "tokens_per_s": r_fault, "free_tokens_per_s": r_free, "window_s": wf[1] - wf[0],
            "tokens_in_window": in_fault, "free_tokens_in_window": in_free,
            "eval_loss_vs_free_at_equal_steps": fault["eval_loss"] / free["eval_loss"] - 1,
            "tokens_vs_free": fault["committed_tokens"] / free["committed_tokens"] - 1}


# --- running the jobs (not pure) -----------------------------------------------------------------------

