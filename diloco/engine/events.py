"""What the engine reports and raises: one ``SyncEvent`` per launch or commit of a fragment's
exchange, and ``NonFiniteError`` when a pseudo-gradient holds NaN or Inf."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class NonFiniteError(FloatingPointError):
    """A pseudo-gradient (local or averaged) holds NaN or Inf; nothing was applied."""


@dataclass(frozen=True)
class SyncEvent:
    """One thing the engine did to one fragment at an inner step."""

    fragment: int
    round: int  # this fragment's round id (0-based)
    kind: Literal["launch", "commit"]  # launch: exchange started; commit: outer step applied
    inner_step: int  # inner steps done when it happened
    numel: int  # elements of this fragment (the exchange's vector length)
    next_period: int = 0  # launch: H until this fragment's next sync (0: none before the end)
    delta_norm: float | None = None  # commit: L2 norm of the applied pseudo-gradient (None: none)
