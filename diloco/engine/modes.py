"""The sync modes by name and what each allows and defaults to, torch-free so a configuration
validates without loading torch.

``MODE_TRAITS`` is the registry (``--mode``'s choices besides ``dp``); a mode's steps are its
``SyncMode`` class (``diloco.engine.sync_modes.MODE_CLASSES``). Checks, help and the outer rule's
defaults read the traits here: a new mode is one entry here and its class there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

Mode = Literal["blocking", "overlap", "eager", "delayed", "co2"]


@dataclass(frozen=True)
class ModeTraits:
    """What a sync mode allows and its defaults."""

    summary: str  # the mode in a few words (``--mode``'s help)
    outer: tuple[float, float] | None  # outer Nesterov (lr, momentum) unless told (None: CO2's own step)
    default_tau: int = 0  # τ, inner steps between a launch and its landing, when ``overlap_steps`` is not given
    takes_tau: bool = False  # ``overlap_steps`` may be set
    default_alpha: float = 0.0  # merge α (local = α·local + (1−α)·global) when ``merge_alpha`` is not given
    time_rounds: bool = False  # runs rounds by time (``--round-seconds``)
    round_grid: bool = False  # rounds by time on a fixed grid (no barrier at a launch)
    error_feedback: bool = True  # runs with a codec that needs error feedback (int2, sign1, topk)
    final_codec: bool = True  # runs a final codec for its last exchange (an outer step on a mean of Δs)
    streams: bool = False  # its outer step is the landed mean's, stepped range by range as the mean arrives


# Outer Nesterov defaults: why each, diloco/engine/outer.py's doc. α = 0.5 only where τ local steps ran
# since Δ was measured (overlap); the other modes step at the sync itself, and their papers start the next
# round from the new θ_global (α = 0).
MODE_TRAITS: dict[str, ModeTraits] = {
    "blocking": ModeTraits("blocking DiLoCo", (0.7, 0.9), time_rounds=True, streams=True),
    "overlap": ModeTraits("overlap (Streaming DiLoCo, tau steps)", (0.7, 0.9), default_tau=1, takes_tau=True,
                          default_alpha=0.5, time_rounds=True, round_grid=True, streams=True),
    "eager": ModeTraits("eager", (0.7, 0.5),  # half of the update is one round stale: μ 0.9 overshoots
                        error_feedback=False, final_codec=False),
    "delayed": ModeTraits("delayed (naive)", (0.7, 0.0)),  # all of it is: Nesterov 0.7/0.9 diverges
    "co2": ModeTraits("co2", None),
}
MODES: tuple[str, ...] = tuple(MODE_TRAITS)
MODE_DEFAULTS: dict[str, tuple[float, float]] = {m: t.outer for m, t in MODE_TRAITS.items() if t.outer is not None}
# CO2's own outer step: the authors' released defaults for <= 16 workers (docs/algorithms.md §5.1 [V]).
CO2_DEFAULTS: dict = {"lr": 1.0, "momentum": 0.0, "clip": 1.0, "penalty": "adaptive"}

InitialSync = Literal["check", "copy"]
INITIAL_SYNCS: tuple[str, ...] = ("check", "copy")

#: the most fragments an engine syncs: each has at most one exchange in flight, and the coordinator
#: refuses an exchange asked more than ``rounds.MAX_EXCHANGES_AHEAD`` (64) past the job's position
MAX_FRAGMENTS = 32

_FLAGS = {f.name for f in fields(ModeTraits) if f.type == "bool"}


def modes_where(trait: str) -> tuple[str, ...]:
    """The modes with boolean trait ``trait`` (e.g. ``"time_rounds"``), in ``MODES`` order."""
    if trait not in _FLAGS:
        raise ValueError(f"unknown mode trait {trait!r}; known: {', '.join(sorted(_FLAGS))}")
    return tuple(m for m, t in MODE_TRAITS.items() if getattr(t, trait))


def in_words(modes: tuple[str, ...]) -> str:
    """``blocking, overlap, delayed or co2``."""
    return modes[0] if len(modes) == 1 else f"{', '.join(modes[:-1])} or {modes[-1]}"
