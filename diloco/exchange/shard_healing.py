"""Healing a sharded group: which shard a healer rank joins with, and the check of what it fetched.

A sharded (FSDP2) group that heals joins its first exchange with zeros of its own shard's length
(``healing_layout``), and each of its ranks fetches the engine state of the donor rank that holds
the same shard (healer rank r from donor rank r: the groups must have the same size, see
``refuse_other_sizes``). The quorum's agreed hash is of the whole model, so no rank can check it
alone: ``sharded_check`` builds the collective check every healer rank runs once, whether its own
fetch worked or not — all ranks then vote alike.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from compress.fingerprint_parts import finish, rows_part
from diloco.engine.shard_layout import ShardLayout
from diloco.engine.shard_reduce import all_gather_cpu

_FRAGMENT = re.compile(r"f(\d+)/")


def healing_layout(engine: Any, tag: str) -> ShardLayout | None:
    """The shard layout of the fragment exchanged under ``tag`` (None: the model is not sharded)."""
    sharded = getattr(engine, "sharded", None)
    if sharded is None:
        return None
    match = _FRAGMENT.match(tag)
    if match is None or int(match.group(1)) >= len(sharded.layouts):
        raise ValueError(f"cannot heal into exchange {tag!r}: not a fragment sync of this engine")
    return sharded.layouts[int(match.group(1))]


def refuse_other_sizes(engine: Any, resp: Any, group: int) -> None:
    """A sharded group heals only from a donor group of its own size (each rank fetches the shard
    it holds from the rank that holds the same one); ValueError otherwise, saying what to do."""
    if getattr(engine, "sharded", None) is None or resp.donor < 0:
        return
    mine, theirs = len(resp.members[group]), len(resp.members[resp.donor])
    if mine != theirs:
        raise ValueError(f"group {group} ({mine} ranks, sharded) cannot heal from group {resp.donor} ({theirs} "
                         "ranks): a sharded group heals from a group of its own size. Restart it with "
                         f"{theirs} ranks, or resume the job from a checkpoint (which reshards)")


def sharded_check(engine: Any, resp: Any) -> Callable[[Any], tuple[bool, str]] | None:
    """The collective check of a sharded healer's fetched states (None: the model is not
    sharded): every rank passes its state (None if its fetch failed); all get (ok, why)."""
    sharded = getattr(engine, "sharded", None)
    if sharded is None:
        return None

    def check(state: Any) -> tuple[bool, str]:
        ok, part = 1, 0
        if state is not None:
            try:
                part = _rows_of(state, sharded.layouts)
            except (KeyError, TypeError, ValueError):
                ok = 0
        mine = torch.tensor([ok, part - (1 << 64) if part >> 63 else part], dtype=torch.int64)
        parts = all_gather_cpu(mine, sharded.group)
        if not all(int(p[0]) for p in parts):
            return False, "a rank of this group did not get a state that fits its shard"
        lengths = [rows * per_row for lay in sharded.layouts for rows, per_row in lay.shapes]
        got = f"{finish(sum(int(p[1]) for p in parts) & ((1 << 64) - 1), lengths):016x}"
        if resp.state_hash and got != resp.state_hash:
            return False, f"the shards' global hash {got} is not the quorum's {resp.state_hash}"
        return True, ""

    return check


def _rows_of(state: dict, layouts: list[ShardLayout]) -> int:
    """This rank's part of the fingerprint of the global parameters in ``state`` (its shards)."""
    frags = state["fragments"]
    if len(frags) != len(layouts):
        raise ValueError(f"a state of {len(frags)} fragments for {len(layouts)}")
    pieces, base = [], 0
    for frag, layout in zip(frags, layouts):
        tensors = list(frag["global"].values())
        spans = layout.pieces()
        if len(tensors) != len(spans) or any(t.numel() != b - a for t, (a, b) in zip(tensors, spans)):
            raise ValueError("the state's shards do not match this rank's layout")
        pieces += [(t, base + a) for t, (a, _) in zip(tensors, spans)]
        base += layout.numel
    return rows_part(pieces)
