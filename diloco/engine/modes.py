"""The names the engine accepts and the outer step each mode defaults to, torch-free so a configuration
validates without loading torch."""

from __future__ import annotations

from typing import Literal

Mode = Literal["blocking", "overlap", "eager", "delayed", "co2"]
MODES: tuple[str, ...] = ("blocking", "overlap", "eager", "delayed", "co2")

InitialSync = Literal["check", "copy"]
INITIAL_SYNCS: tuple[str, ...] = ("check", "copy")

#: the most fragments an engine syncs: each has at most one exchange in flight, and the coordinator
#: refuses an exchange asked more than ``rounds.MAX_EXCHANGES_AHEAD`` (64) past the job's position
MAX_FRAGMENTS = 32

# Outer Nesterov (lr, momentum) each sync mode uses unless told otherwise; why: diloco/engine/outer.py's doc.
MODE_DEFAULTS: dict[str, tuple[float, float]] = {
    "blocking": (0.7, 0.9),
    "overlap": (0.7, 0.9),
    "eager": (0.7, 0.5),  # half of the update is one round stale: μ 0.9 overshoots
    "delayed": (0.7, 0.0),  # all of it is: Nesterov 0.7/0.9 diverges
}
# CO2's own outer step: the authors' released defaults for <= 16 workers (docs/algorithms.md §5.1 [V]).
CO2_DEFAULTS: dict = {"lr": 1.0, "momentum": 0.0, "clip": 1.0, "penalty": "adaptive"}
