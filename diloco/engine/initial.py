"""Every group starts from the same global parameters: checked by hash, or copied from group 0.

Both travel over the groups' own averager as one lossless (fp32) exchange of exact small
integers, so the mean the ring computes (a sum, then a division by G) can be undone exactly:

* ``check``: each group contributes the 16 bytes of the XXH3-128 of its parameters as values
  ``v`` and ``v²``. The mean equals this group's own ``(v, v²)`` everywhere exactly when the
  variance across groups is zero, i.e. when every group holds the same bytes; a difference is
  seen by every group, so all of them refuse. Costs 128 bytes per group.
* ``copy``: group 0 contributes the bits of its fp32 parameters as two 16-bit halves (each an
  exact fp32 integer), the others zeros; ``round(mean · G)`` gives group 0's bits back exactly.
  Costs twice the fp32 model once, at start.
"""

from __future__ import annotations

from typing import Sequence

import torch

from diloco.engine.averaging import Averager
from diloco.engine.modes import INITIAL_SYNCS, InitialSync
from diloco.engine.outer_state import params_digest
from diloco.engine.shard_layout import ShardLayout


class InitialParamsMismatch(RuntimeError):
    """The groups built different initial parameters and ``initial_sync='check'`` refused them."""


def _mean(averager: Averager, flat: torch.Tensor, tag: str) -> torch.Tensor:
    return averager.start(flat, tag=tag, exact=True).wait().to(flat.device)


@torch.no_grad()
def check_same(averager: Averager, params: Sequence[torch.Tensor], *, tag: str = "init/check") -> None:
    """Raise ``InitialParamsMismatch`` on every group unless all groups hold the same ``params``."""
    own = params_digest(params)
    v = torch.tensor(list(own), dtype=torch.float32)
    mean = _mean(averager, torch.cat([v, v * v]), tag)
    if not torch.equal(mean, torch.cat([v, v * v])):
        raise InitialParamsMismatch(
            f"the groups start from different parameters (this group's hash {own.hex()[:16]}): "
            "build the model under the same torch.manual_seed in every group or load the same "
            "checkpoint, or let group 0's parameters be copied to all (initial_sync='copy', "
            "CLI --initial-sync copy)"
        )


@torch.no_grad()
def copy_from_first(averager: Averager, params: Sequence[torch.Tensor], *, tag: str = "init/copy",
                    shards: ShardLayout | None = None) -> None:
    """Overwrite ``params`` (fp32) on every group with group 0's values, bit for bit.
    ``shards``: ``params`` are this rank's shards of a sharded model laid out so; each rank then
    exchanges its shard with the ranks of the other groups that hold the same elements."""
    if any(p.dtype != torch.float32 for p in params):
        raise ValueError("copy_from_first needs fp32 tensors (the engine's global copy)")
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    bits = flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    halves = torch.cat([bits >> 16, bits & 0xFFFF]).to(torch.float32)
    if averager.group_index != 0:
        halves.zero_()
    if shards is None:
        mean = _mean(averager, halves, tag)
    else:  # the high halves then the low ones: the layout of the fragment twice over
        twice = ShardLayout(shards.shapes * 2, shards.size, shards.rank)
        mean = averager.start(halves, tag=tag, exact=True, shards=twice).wait().to(halves.device)
    got = torch.round(mean * averager.num_groups).to(torch.int64)
    n = flat.numel()
    word = (got[:n] << 16) | got[n:]
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    values = word.view(torch.float32)
    offset = 0
    for p in params:
        p.copy_(values[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def agree(averager: Averager, params: Sequence[torch.Tensor], how: InitialSync) -> None:
    """Make (``copy``) or verify (``check``) that every group's ``params`` are identical."""
    if how not in INITIAL_SYNCS:
        raise ValueError(f"initial_sync must be one of {', '.join(INITIAL_SYNCS)}, got {how!r}")
    if averager.num_groups < 2:
        return
    if how == "copy":
        copy_from_first(averager, params)
    else:
        check_same(averager, params)
