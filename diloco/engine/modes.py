"""The names the engine accepts, torch-free so a configuration validates without loading torch."""

from __future__ import annotations

from typing import Literal

Mode = Literal["blocking", "overlap", "eager", "delayed", "co2"]
MODES: tuple[str, ...] = ("blocking", "overlap", "eager", "delayed", "co2")

InitialSync = Literal["check", "copy"]
INITIAL_SYNCS: tuple[str, ...] = ("check", "copy")

#: the most fragments an engine syncs: each has at most one exchange in flight, and the coordinator
#: refuses an exchange asked more than ``rounds.MAX_EXCHANGES_AHEAD`` (64) past the job's position
MAX_FRAGMENTS = 32
