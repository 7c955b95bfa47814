"""``StreamingDiLoCo``: the name of one release ago for ``diloco.DiLoCo`` in a streaming mode.

Everything lives in ``diloco.engine.diloco`` now (one engine for blocking, fragments, overlap, eager,
delayed and CO2). This alias keeps the old defaults (mode ``overlap``, τ = 1, α = 0.5) and will
be removed in the next release.
"""

from __future__ import annotations

from typing import Any

from diloco.engine.diloco import MODES, DiLoCo, SyncEvent, first_syncs
from diloco.engine.modes import modes_where

FragmentEvent = SyncEvent

__all__ = ["StreamingDiLoCo", "FragmentEvent", "MODES", "first_syncs"]


class StreamingDiLoCo(DiLoCo):
    """``DiLoCo`` with ``mode="overlap"`` by default; ``overlap_steps`` only counts for overlap.

    ``merge_alpha`` defaults to the engine's per-mode value: 0.5 for ``overlap`` (the merge after
    τ overlapped steps), 0 for ``eager``/``delayed``/``co2``, whose outer step lands at the sync
    itself and whose next round starts from the new θ_global (it used to be 0.5 for every mode
    here, which kept half of the finished round's local state in the next round's start point).
    """

    def __init__(self, model, inner_optimizer, *, mode: str = "overlap", overlap_steps: int = 1,
                 merge_alpha: float | None = None, **kwargs: Any) -> None:
        super().__init__(model, inner_optimizer, mode=mode,  # type: ignore[arg-type]
                         overlap_steps=overlap_steps if mode in modes_where("takes_tau") else 0,
                         merge_alpha=merge_alpha, **kwargs)
