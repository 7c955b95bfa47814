"""``StreamingDiLoCo``: the name of one release ago for ``diloco.DiLoCo`` in a streaming mode.

Everything lives in ``diloco.engine`` now (one engine for blocking, fragments, overlap, eager,
delayed and CO2). This alias keeps the old defaults (mode ``overlap``, τ = 1, α = 0.5) and will
be removed in the next release.
"""

from __future__ import annotations

from typing import Any

from diloco.engine import MODES, DiLoCo, SyncEvent, first_syncs

FragmentEvent = SyncEvent

__all__ = ["StreamingDiLoCo", "FragmentEvent", "MODES", "first_syncs"]


class StreamingDiLoCo(DiLoCo):
    """``DiLoCo`` with ``mode="overlap"`` by default; ``overlap_steps`` only counts for overlap."""

    def __init__(self, model, inner_optimizer, *, mode: str = "overlap", overlap_steps: int = 1,
                 merge_alpha: float = 0.5, **kwargs: Any) -> None:
        super().__init__(model, inner_optimizer, mode=mode,  # type: ignore[arg-type]
                         overlap_steps=overlap_steps if mode == "overlap" else 0,
                         merge_alpha=merge_alpha, **kwargs)
