"""Where a job started from checkpoints continues, decided by the coordinator as the job starts.

Each group may keep its job checkpoints on its own volume (one per datacenter), so their newest
steps can differ: a group that was down or healing when the others wrote a checkpoint (or when the
job agreed to stop), or one whose volume is new (no checkpoint at all). Every rank joins with the
newest step its group may resume from (-1: none). The job resumes from the newest of them; every
group behind it heals from the groups at it, as a restarted group would, its older checkpoints
not loaded. A step named explicitly (``--resume DIR/step-NNNNNN``) is what was asked for: if any group
named one and the groups' steps differ, the job does not start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping

NONE = -1  # a group with no checkpoint to resume from


@dataclass(frozen=True)
class ResumeStart:
    """``step``: the step the job resumes from (``NONE``: no group has one, a fresh start);
    ``behind``: the groups that heal instead; ``refused``: why the job cannot start (None: it can)."""

    step: int
    behind: tuple[int, ...]
    refused: str | None = None


def describe(steps: Mapping[int, int]) -> str:
    """Every group's newest step, e.g. ``group 0: step 40, group 1: none``."""
    return ", ".join(f"group {g}: {'none' if s == NONE else f'step {s}'}" for g, s in sorted(steps.items()))


def resume_start(steps: Mapping[int, int], named: Collection[int] = ()) -> ResumeStart:
    """The start of a job whose groups joined with newest checkpoint steps ``steps`` (group ->
    step, ``NONE`` for none); ``named``: the groups whose step was named (``--resume DIR/step-N``)."""
    newest = max(steps.values(), default=NONE)
    behind = tuple(sorted(g for g, s in steps.items() if s < newest))
    if named and behind:
        return ResumeStart(newest, behind, refused=(
            f"group(s) {', '.join(map(str, sorted(named)))} named a checkpoint step (--resume DIR/step-NNNNNN), but "
            f"the groups stand at different steps ({describe(steps)}): resume every group from the same step, "
            "or give each its checkpoint folder (--resume DIR, or --resume auto), and the groups behind heal "
            "from the newest"))
    return ResumeStart(newest, behind)
