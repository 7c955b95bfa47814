"""Which step a job started from checkpoints continues at, and which groups heal instead.

Each group may keep its checkpoints on its own volume (one per datacenter), so their newest steps
can differ: a group that was down or healing when the others wrote a checkpoint (or when the job
agreed to stop), or one whose volume was replaced (no checkpoint at all). When the job starts from
checkpoints (``--resume DIR`` or ``--resume auto``), the groups tell each other the newest step each
completed, in one exact exchange; the groups at the newest step resume from it, and every other
group heals from them as a restarted group would (its older checkpoints are not read). A step
folder named explicitly (``--resume DIR/step-NNNNNN``) is what the user asked for: every group must
stand at that step, or all refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from diloco.engine.averaging import Averager
from diloco.runtime.checkpoints.rank_state import STEP_BITS

#: per group: one value that says whether it has a checkpoint, then the step's bits
SLOT = 1 + STEP_BITS
TAG = "resume/newest-step"


@dataclass(frozen=True)
class ResumePlan:
    """``step``: the step the job resumes from (None: no group has a checkpoint, the job starts
    afresh); ``newest``: each group's newest complete step (None: it has none)."""

    step: int | None
    newest: dict[int, int | None]

    def heals(self, group: int) -> bool:
        """Whether ``group`` heals from the groups at ``step`` instead of resuming."""
        return self.step is not None and self.newest[group] != self.step

    def describe(self) -> str:
        """Every group's newest step, e.g. ``group 0: step 40, group 1: none``."""
        return ", ".join(f"group {g}: {'none' if s is None else f'step {s}'}" for g, s in sorted(self.newest.items()))


def plan(newest: Mapping[int, int | None]) -> ResumePlan:
    """The plan for groups whose newest complete steps are ``newest``: the job resumes from the
    newest of them; a group at an older step, or with none, heals."""
    steps = [s for s in newest.values() if s is not None]
    return ResumePlan(max(steps) if steps else None, dict(newest))


def encode(step: int | None, group: int, groups: int) -> torch.Tensor:
    """``groups`` slots of ``SLOT`` fp32 values, zero but for ``group``'s: 1 if it has a step,
    then the step's bits (0/1). The mean over the groups then holds every group's slot."""
    if not 0 <= group < groups:
        raise ValueError(f"group {group} outside [0, {groups})")
    out = torch.zeros(groups * SLOT, dtype=torch.float32)
    if step is not None:
        if not 0 <= step < 2**STEP_BITS:
            raise ValueError(f"step {step} outside [0, 2**{STEP_BITS})")
        slot = out[group * SLOT:(group + 1) * SLOT]
        slot[0] = 1.0
        slot[1:] = torch.tensor([(step >> i) & 1 for i in range(STEP_BITS)], dtype=torch.float32)
    return out


def decode(mean: torch.Tensor, groups: int) -> dict[int, int | None]:
    """Inverse of ``encode`` on the mean of every group's vector (a set value is 1/G there, or
    its weight share: anything above 0 is set). ValueError on a vector of another size."""
    if mean.numel() != groups * SLOT:
        raise ValueError(f"a resume-step vector of {mean.numel()} values, expected {groups * SLOT} ({groups} groups)")
    bits = (mean.detach().to("cpu", torch.float32).reshape(groups, SLOT) > 0).tolist()
    return {g: sum(1 << i for i, b in enumerate(slot[1:]) if b) if slot[0] else None
            for g, slot in enumerate(bits)}


@torch.no_grad()
def agree(averager: Averager, step: int | None, *, group: int, groups: int, exact_step: bool = False) -> ResumePlan:
    """Tell the other groups this group's newest complete step (``step``; None: it has none)
    and return the job's plan; every group computes the same one. ``exact_step``: the step was
    named (``--resume DIR/step-NNNNNN``): ValueError unless every group stands at it."""
    if getattr(averager, "num_groups", 1) < 2:
        return plan({group: step})
    mean = averager.start(encode(step, group, groups), tag=TAG, exact=True).wait()
    newest = decode(mean, groups)
    if newest[group] != step:
        raise ValueError(f"{TAG}: this group's own step came back as {newest[group]}, it sent {step}: the groups "
                         "do not agree on how many groups the job has")
    agreed = plan(newest)
    if exact_step and len(set(newest.values())) > 1:
        raise ValueError(f"{TAG}: the groups are not at the same step ({agreed.describe()}); resume every group "
                         "from the same checkpoint step (--resume DIR/step-NNNNNN), or give each its checkpoint "
                         "folder (--resume DIR): the groups behind then heal from the newest")
    return agreed
