"""What the engine needs to run on a model sharded inside the group (FSDP2's ``fully_shard``).

Each rank keeps only its shard of the fp32 global copy and of the outer optimizer's state
(``OuterFragment`` works on the DTensors' local parts), computes Δ on it, exchanges it with the
ranks of the other groups that hold the same elements (the averager's ``shards=`` argument, a
``ShardLayout``), and applies the outer step and the merge to it. Nothing materializes the whole
model on one rank. What needs the whole fragment is computed collectively inside the group, at
the same point of the control flow on every rank (``diloco.engine.shard_reduce``):

* the global hash (after every change of the global copy, cached: ``global_hash()`` is then free
  and may be called by one rank alone, as the quorum's lead and the round reports do);
* the norms of events (``delta_norm``) and of CO2's staleness penalty (exactly rounded, so
  groups of different sizes take the same outer step);
* the initial agreement: ``check`` compares the whole model's fingerprint, ``copy`` sends group
  0's values shard by shard.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from diloco.engine.averaging import Averager, Capabilities
from diloco.engine.initial import InitialParamsMismatch, copy_from_first
from diloco.engine.modes import INITIAL_SYNCS, InitialSync
from diloco.engine.outer_state import OuterFragment
from diloco.engine.shard_layout import ShardingError, ShardLayout, describe, is_sharded
from diloco.engine.shard_reduce import exact_sum_of_squares, group_fingerprint, sum_of_squares

_SHARDED_MARK = b"FSDP2\x00\x00\x01"  # the check's second half: an unsharded group's hash never matches


class ShardedState:
    """Layouts and in-group collectives of an engine over a sharded model (see module doc)."""

    def __init__(self, layouts: list[ShardLayout], mesh: Any) -> None:
        self.layouts = layouts
        self.mesh = mesh
        self.group = mesh.get_group()
        #: the layout of every fragment's parameters in fragment order (one vector of the whole model)
        self.whole = ShardLayout(tuple(s for lay in layouts for s in lay.shapes), layouts[0].size, layouts[0].rank)
        self.hash = ""

    @classmethod
    def of(cls, fragments: Sequence[OuterFragment], averager: Averager) -> "ShardedState | None":
        """None for an unsharded model; else the state, once the sharding and the averager were
        found fit: ``ShardingError``/``ValueError`` say what is not."""
        params = [p for f in fragments for p in f.local_params]
        if not is_sharded(params):
            return None
        if not Capabilities.of(averager).exchanges_shards:
            raise ValueError(f"{type(averager).__name__} cannot exchange a sharded model's shards: use "
                             "diloco.connect(...) (or diloco.SingleGroup() for one group)")
        described = [describe(f.names, f.local_params) for f in fragments]
        if any(m != described[0][1] for _, m in described):
            raise ShardingError("the fragments' parameters are sharded over different device meshes")
        state = cls([lay for lay, _ in described], described[0][1])
        for frag in fragments:  # outer rules that need a norm of the whole fragment get it exactly
            if hasattr(frag.optimizer, "sum_squares"):
                frag.optimizer.sum_squares = state.exact_sum_of_squares
        return state

    # --- collectives of the group ---------------------------------------------------------------

    def rehash(self, fragments: Sequence[OuterFragment]) -> None:
        """Hash the whole global copy (every rank's shard) into ``hash``: a group collective."""
        pieces, lengths, base = [], [], 0
        for frag, layout in zip(fragments, self.layouts):
            for g, (a, _), n in zip(frag.global_params, layout.pieces(), (p.numel() for p in frag.local_params)):
                pieces.append((g, base + a))
                lengths.append(n)
            base += layout.numel
        self.hash = f"{group_fingerprint(pieces, lengths, self.group):016x}"

    def norm(self, flat: torch.Tensor) -> float:
        """L2 norm of a fragment's vector over every rank's shard (fp64 sums): a group collective."""
        return math.sqrt(sum_of_squares([flat], self.group))

    def exact_sum_of_squares(self, tensors: Sequence[torch.Tensor]) -> float:
        """Σx² over every rank's shard of ``tensors``, exactly rounded: a group collective."""
        return exact_sum_of_squares(tensors, self.group)

    def agree(self, averager: Averager, params: Sequence[torch.Tensor], how: InitialSync) -> None:
        """Make (``copy``, shard by shard) or verify (``check``, by the whole model's fingerprint)
        that every group starts from the same global parameters (``params``: this rank's shards)."""
        if how not in INITIAL_SYNCS:
            raise ValueError(f"initial_sync must be one of {', '.join(INITIAL_SYNCS)}, got {how!r}")
        if averager.num_groups < 2:
            return
        if how == "copy":
            copy_from_first(averager, params, shards=self.whole)
            return
        lengths = [rows * per_row for rows, per_row in self.whole.shapes]
        pieces = list(zip(params, (a for a, _ in self.whole.pieces())))
        fp = group_fingerprint(pieces, lengths, self.group)
        # 16 values like an unsharded group's XXH3-128 check, which differs from this one by design
        v = torch.tensor([*fp.to_bytes(8, "little"), *_SHARDED_MARK], dtype=torch.float32)
        mean = averager.start(torch.cat([v, v * v]), tag="init/check", exact=True).wait().to(v.device)
        if not torch.equal(mean, torch.cat([v, v * v])):
            raise InitialParamsMismatch(
                f"the groups start from different parameters (this group's fingerprint {fp:016x}), or some "
                "groups shard their model (FSDP) and others do not: build the model under the same "
                "torch.manual_seed in every group, shard it in every group, or let group 0's parameters "
                "be copied to all (initial_sync='copy', CLI --initial-sync copy)")

    # --- views ----------------------------------------------------------------------------------

    def global_state_dict(self, fragments: Sequence[OuterFragment]) -> dict[str, torch.Tensor]:
        """The global parameters by name as DTensors sharded like the model's (fp32 copies)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for frag in fragments:
            for n, g, p in zip(frag.names, frag.global_params, frag.local_params):
                out[n] = DTensor.from_local(g.detach().clone(), p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
        return out
