"""Every group's committed data position: what the job holds so that every sample is trained once.

*Trained once*, precisely: a sample counts when the exchange that carries the contribution it
was trained in commits to the global model with that contribution's weight above 0. If the
exchange is rolled back it is retried with the same contribution (still uncounted until one
attempt commits); if the quorum refuses the contribution (NaN/Inf, an outlier: weight 0), or the
group dies before its contribution commits, the samples it consumed are not counted and must be
consumed again by that group (after a refusal at once, after a death when it heals or resumes).
So a group's *committed* position advances only at a commit, and a group continues from it.

Units. The weights the quorum commits are the contributions' inner steps times each group's
``tokens_per_step`` (``diloco.exchange.quorum_averager``), so a committed weight divided by the
group's own ``tokens_per_step`` is the number of *data steps* (batches of the group's ranks)
committed. The group's data source turns steps into samples (``samples_per_step``: the group's
ranks times the rank batch), so positions are in samples of the group's own stream.

Where it lives: every rank of every group keeps the whole table ``{fragment: {group: committed
weight}}``, adding each committed exchange's weights when the exchange commits (every member
sees the same committed weights, so every survivor holds the same table). A donor sends its table
with its engine state to a healer, which then holds its own group's committed position; every
rank's checkpoint holds the table too. With fragments (Streaming DiLoCo) a group's position is
the least over its fragments: a sample counts when every fragment's exchange after it committed.

``DataPositions.ledger`` lists the sample ranges this process saw its own group commit;
``check_ledger`` tells from the ranges of every incarnation of every group whether any sample
was counted twice or left out. A process may die (or freeze, and be evicted) after its group's
contribution committed but before it saw the commit: the range is committed, yet its log never
says so. So the table also keeps each group's last few position advances (``ADVANCES_KEPT``),
a healer logs its own group's again (``log_inherited``), and ``ledger_from_logs`` counts a range
logged twice *for the same exchange* once.

A job resumed from checkpoints (after a stop, or after every group was lost) continues from the
checkpoint's table: whatever its groups committed after the checkpoint was lost with them and is
trained again. So a resume logs the rounds its table holds (``log_resumed``), and
``ledger_from_logs`` drops the ranges that group logged earlier for later rounds.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)

FRAGMENT_TAG = re.compile(r"f(\d+)/r(\d+)")
#: position advances kept per group in the table (before, after, exchange tag): a process sees
#: every commit of one fragment before it votes on that fragment's next, so with fragments it can
#: have missed at most one per fragment
ADVANCES_KEPT = 8


class PositionError(ValueError):
    """A data-position table that does not fit (malformed, or weights that are not whole steps)."""


class DataPositions:
    """The committed-weight table of one rank and its own group's committed position.

    ``group``: this rank's group. ``tokens_per_step``: the weight one inner step of this group
    carries (the quorum averager's). ``samples_per_step`` (set by whoever draws the data, 0 until
    then): samples the group's position advances per data step; the ledger is kept in samples
    when it is set, else in steps. Thread-safe: commits arrive on exchange threads.
    """

    def __init__(self, group: int, tokens_per_step: float) -> None:
        if tokens_per_step <= 0:
            raise PositionError(f"tokens_per_step must be > 0, got {tokens_per_step}")
        self.group, self.tokens_per_step = group, float(tokens_per_step)
        self.fragments = 1
        self.samples_per_step = 0
        self._committed: dict[int, dict[int, float]] = {}
        self._rounds: dict[int, int] = {}  # fragment -> its last round counted (a commit counts once)
        self._refused = False
        self._advances: dict[int, list[tuple[float, float, str]]] = {}  # group -> last ADVANCES_KEPT
        self._lock = threading.Lock()
        #: (first, end) half-open ranges of this group's stream committed while this process ran
        self.ledger: list[tuple[int, int]] = []

    def committed_steps(self, group: int | None = None) -> int:
        """Data steps of ``group`` (default this one) whose contributions committed; only this
        group's steps are exact (the others' weights are divided by this group's tokens_per_step)."""
        g = self.group if group is None else group
        with self._lock:
            return self._steps(g)

    def committed_samples(self) -> int:
        """This group's committed position in samples (``samples_per_step`` must be set)."""
        if self.samples_per_step <= 0:
            raise PositionError("samples_per_step is not set: the data source did not say what a step holds")
        return self.committed_steps() * self.samples_per_step

    def _weight(self, group: int) -> float:
        """``group``'s committed weight: the least over the fragments."""
        return min(self._committed.get(p, {}).get(group, 0.0) for p in range(self.fragments))

    def _steps(self, group: int) -> int:
        total = self._weight(group)
        steps = total / self.tokens_per_step
        if abs(steps - round(steps)) > 1e-6:
            raise PositionError(f"group {group}'s committed weight {total} is not a whole number of steps of "
                                f"{self.tokens_per_step}")
        return round(steps)

    def commit(self, tag: str, weights: Mapping[int, float], *, refused: bool = False) -> None:
        """The exchange ``tag`` committed with ``weights`` (by group); exchanges that are not a
        fragment's round (control exchanges) carry no data and are ignored, and so is a round the
        table counted already (a donor's table may hold it). ``refused``: this group's
        contribution was refused (its samples are to be consumed again: ``take_refused``)."""
        match = FRAGMENT_TAG.fullmatch(tag)
        if match is None:
            return
        p, r = int(match.group(1)), int(match.group(2))
        with self._lock:
            if r <= self._rounds.get(p, -1):
                return
            self._rounds[p] = r
            before = self._steps(self.group)
            row = self._committed.setdefault(p, {})
            counted = [int(g) for g, w in weights.items() if w > 0]
            was = {g: self._weight(g) for g in counted}
            for g, w in weights.items():
                if w > 0:
                    row[int(g)] = row.get(int(g), 0.0) + float(w)
            for g in counted:
                if self._weight(g) > was[g]:
                    kept = self._advances.setdefault(g, [])
                    kept.append((was[g], self._weight(g), tag))
                    del kept[:-ADVANCES_KEPT]
            after = self._steps(self.group)
            self._refused = self._refused or refused
            unit = self.samples_per_step or 1
            if after > before:
                self.ledger.append((before * unit, after * unit))
        if after > before:
            self._log_range(before * unit, after * unit, tag)

    def _log_range(self, first: int, end: int, tag: str, note: str = "") -> None:
        unit = "samples" if self.samples_per_step else "steps"
        log.info("group %d committed data %s [%d, %d) at %s%s", self.group, unit, first, end, tag, note,
                 extra={"data_group": self.group, "data_first": first, "data_end": end, "data_unit": unit,
                        "data_tag": tag})

    def log_inherited(self) -> None:
        """A healer, once its table is the donor's and ``samples_per_step`` set: log again its own
        group's last position advances, which its previous process may not have seen commit
        (``ledger_from_logs`` counts a range logged twice for the same exchange once)."""
        with self._lock:
            advances = list(self._advances.get(self.group, ()))
        unit = self.samples_per_step or 1
        for before, after, tag in advances:
            self._log_range(round(before / self.tokens_per_step) * unit, round(after / self.tokens_per_step) * unit,
                            tag, " (its previous start's, from the donor's table)")

    def log_resumed(self) -> None:
        """Rank 0 of a group resumed from a checkpoint whose table this is: log the last round it
        counted per fragment. ``ledger_from_logs`` then drops the ranges this group logged before
        for later rounds: their commits were lost with the job and their samples are trained again."""
        with self._lock:
            rounds = sorted(self._rounds.items())
        kept = " ".join(f"f{p}/r{r}" for p, r in rounds)
        log.info("group %d resumed its committed data after [%s]", self.group, kept,
                 extra={"data_group": self.group, "data_resume": kept})

    def take_refused(self) -> bool:
        """True once after a commit that refused this group's contribution."""
        with self._lock:
            refused, self._refused = self._refused, False
            return refused

    def state(self) -> dict[str, Any]:
        """The table as plain values (JSON-able): what a donor sends and a checkpoint holds."""
        with self._lock:
            rows = [[p, g, w] for p, row in sorted(self._committed.items()) for g, w in sorted(row.items())]
            rounds = [[p, r] for p, r in sorted(self._rounds.items())]
            advances = [[g, a, b, tag] for g, kept in sorted(self._advances.items()) for a, b, tag in kept]
        return {"fragments": self.fragments, "committed": rows, "rounds": rounds, "advances": advances}

    def load_state(self, state: Mapping[str, Any] | None) -> None:
        """Take the table ``state()`` returned (a donor's, a checkpoint's); PositionError if malformed."""
        if state is None:
            raise PositionError("no data-position table (a donor or a checkpoint of an older version?)")
        rows = state.get("committed") if isinstance(state, Mapping) else None
        rounds = state.get("rounds") if isinstance(state, Mapping) else None
        if not isinstance(rows, list) or not isinstance(rounds, list):
            raise PositionError(f"a data-position table has 'committed' and 'rounds' lists, got {state!r:.200}")
        if not all(isinstance(x, (list, tuple)) and len(x) == 2 and all(type(v) is int for v in x) for x in rounds):
            raise PositionError(f"bad data-position rounds {rounds!r:.100}")
        table: dict[int, dict[int, float]] = {}
        for row in rows:
            if not (isinstance(row, (list, tuple)) and len(row) == 3 and all(type(v) is int for v in row[:2])
                    and isinstance(row[2], (int, float)) and row[2] >= 0):
                raise PositionError(f"bad data-position row {row!r:.100}")
            table.setdefault(row[0], {})[row[1]] = float(row[2])
        advances: dict[int, list[tuple[float, float, str]]] = {}
        for row in state.get("advances", []):  # absent in a table of an older version
            if not (isinstance(row, (list, tuple)) and len(row) == 4 and type(row[0]) is int
                    and all(isinstance(v, (int, float)) and v >= 0 for v in row[1:3]) and isinstance(row[3], str)
                    and FRAGMENT_TAG.fullmatch(row[3])):
                raise PositionError(f"bad data-position advance {row!r:.100}")
            advances.setdefault(row[0], []).append((float(row[1]), float(row[2]), row[3]))
        with self._lock:
            self._committed, self._rounds = table, {int(p): int(r) for p, r in rounds}
            self._advances = {g: kept[-ADVANCES_KEPT:] for g, kept in advances.items()}


@dataclass
class LedgerCheck:
    """What ``check_ledger`` found for one group: samples counted, counted twice, left out."""

    group: int
    counted: int
    end: int  # the furthest committed sample + 1
    twice: list[tuple[int, int]] = field(default_factory=list)  # ranges committed more than once
    gaps: list[tuple[int, int]] = field(default_factory=list)  # ranges below ``end`` never committed

    @property
    def ok(self) -> bool:
        return not self.twice and not self.gaps


def check_ledger(ranges: Mapping[int, Iterable[tuple[int, int]]]) -> dict[int, LedgerCheck]:
    """For each group, its committed ranges (from every incarnation's ``ledger``, any order):
    whether they tile ``[0, end)`` exactly once. Pure; ``LedgerCheck.ok`` is the verdict."""
    out = {}
    for g, rs in ranges.items():
        spans = sorted((int(a), int(b)) for a, b in rs if b > a)
        check = LedgerCheck(g, sum(b - a for a, b in spans), max((b for _, b in spans), default=0))
        reach = 0
        for a, b in spans:
            if a > reach:
                check.gaps.append((reach, a))
            elif a < reach:
                check.twice.append((a, min(b, reach)))
            reach = max(reach, b)
        out[g] = check
    return out


_TEXT_RECORD = re.compile(r"\[worker group (\d+) rank (\d+)\] group (\d+) committed data (samples|steps) "
                          r"\[(\d+), (\d+)\)(?: at (f\d+/r\d+))?")
_TEXT_RESUME = re.compile(r"\[worker group (\d+) rank (\d+)\] group (\d+) resumed its committed data after "
                          r"\[([^\]]*)\]")


def ledger_from_logs(lines: Iterable[str]) -> dict[int, list[tuple[int, int]]]:
    """Every group's committed ranges from worker log lines (text or JSON, of every incarnation of
    every group; each group's lines in the order they were written, groups in any order): what
    rank 0 of each group logged at each commit (``DataPositions.commit``). A range logged again for
    the same exchange (a healer's ``log_inherited``) counts once; a resume from a checkpoint
    (``log_resumed``) drops the ranges its group logged before for rounds after the checkpoint's.
    Feed the result to ``check_ledger``. Lines of other records are skipped."""
    out: dict[int, dict[tuple, None]] = {}  # per group, its ranges in order (a dict: tagged ones once)
    for n, line in enumerate(lines):
        record = _ledger_record(line)
        if record is None:
            continue
        group, first, end, tag, resume = record
        ranges = out.setdefault(group, {})
        if resume is not None:
            out[group] = {k: None for k in ranges if k[2] is None or _within(k[2], resume)}
        else:  # an untagged range (an older version's) is never taken for another
            ranges[(first, end, tag) if tag else (first, end, None, n)] = None
    return {g: [(k[0], k[1]) for k in ranges] for g, ranges in out.items()}


def _ledger_record(line: str) -> tuple[int, int, int, str | None, dict[int, int] | None] | None:
    """(group, first, end, tag, None) of a rank-0 committed-range line, (group, 0, 0, None,
    {fragment: last round}) of a rank-0 resume line, else None."""
    if "committed data" not in line:
        return None
    if line.lstrip().startswith("{"):
        try:
            rec = json.loads(line)
        except ValueError:
            return None
        if not isinstance(rec, dict) or rec.get("rank") != 0 or "data_group" not in rec:
            return None
        if "data_resume" in rec:
            return int(rec["data_group"]), 0, 0, None, _resume_rounds(str(rec["data_resume"]))
        return int(rec["data_group"]), int(rec["data_first"]), int(rec["data_end"]), rec.get("data_tag"), None
    m = _TEXT_RESUME.search(line)
    if m is not None:
        return (int(m.group(3)), 0, 0, None, _resume_rounds(m.group(4))) if m.group(2) == "0" else None
    m = _TEXT_RECORD.search(line)
    if m is None or m.group(2) != "0":
        return None
    return int(m.group(3)), int(m.group(5)), int(m.group(6)), m.group(7), None


def _resume_rounds(text: str) -> dict[int, int]:
    """``{fragment: round}`` from a resume record's ``f0/r12 f1/r11``."""
    return {int(m.group(1)): int(m.group(2)) for m in FRAGMENT_TAG.finditer(text)}


def _within(tag: str, resume: dict[int, int]) -> bool:
    """The exchange ``tag`` is one a resume's table counted (a fragment it never saw: none is)."""
    m = FRAGMENT_TAG.fullmatch(tag)
    return m is None or int(m.group(2)) <= resume.get(int(m.group(1)), -1)


def merged(ranges: Iterable[tuple[int, int]]) -> list[list[int]]:
    """``ranges`` in order with exactly adjacent ones joined (overlaps are kept apart, so a
    sample counted twice still shows): a short form of a ledger."""
    out: list[list[int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([int(a), int(b)])
    return out
