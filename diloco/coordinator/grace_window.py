"""The grace window (``--quorum-grace``): how long an exchange's quorum waits for groups that have
not asked yet, and which silent groups are failed under it rather than waited for.

An exchange's window starts once a strict majority of the live groups still heard from asked for it
(``_majority_asked``); it ends ``quorum_grace_s`` later, or at once when none of the groups it waits
for is heard from any more (``_grace_left``, ``rounds.window_closed``). With a window on, a group
silent for three heartbeat intervals is failed when it is a member of an exchange in flight or was
left out by a window (``_sweep``). ``round_state.RoundState`` forms the quorums on top of this.
"""

from __future__ import annotations

from typing import Any, Callable

from . import rounds
from .ask_book import AskBook
from .liveness import Liveness

MAX_WINDOWS_KEPT = 1024  # exchanges whose window start is remembered, oldest dropped first


class GraceWindow(Liveness):
    """The grace window's clock and its silence rules, on ``Liveness``, under ``Joins``' lock. The
    rounds part (``RoundState``) keeps the asks (``_book``), quorums, decisions and groups left
    behind that these rules read, and ``_group_asks`` / ``_live``."""

    _book: AskBook
    _quorums: dict[str, tuple[rounds.Quorum, dict[str, Any]]]
    _decisions: dict[str, tuple[bool, str]]
    _behind: dict[int, dict[int, str]]

    def __init__(self, expected_groups: int, *, join_timeout_s: float, heartbeat_timeout_s: float,
                 max_group_size: int, clock: Callable[[], float], quorum_grace_s: float) -> None:
        super().__init__(expected_groups, join_timeout_s=join_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
                         max_group_size=max_group_size, clock=clock)
        if not 0 <= quorum_grace_s < float("inf"):
            raise ValueError(f"quorum_grace_s must be >= 0 seconds (0: off), got {quorum_grace_s}")
        # with it > 0, an exchange's quorum forms this long after its first ask with the groups that
        # asked by then, if they are a majority of those heard from (rounds.decide); the live groups
        # left out catch up when they ask, or are failed once silent (vote_state._left_behind)
        self.quorum_grace_s = quorum_grace_s
        self._grace_from: dict[int, float] = {}  # exchange -> when a majority had asked for the attempt being formed

    def _group_asks(self, exchange: int) -> dict[int, rounds.Ask]:
        raise NotImplementedError

    def _live(self) -> set[int]:
        raise NotImplementedError

    def _sweep(self) -> None:
        """Besides the heartbeat timeout, with a grace window (``--quorum-grace``) a group silent for
        three heartbeat intervals is failed now (lock held) when it is a member of an exchange in flight
        (its quorum formed, not yet decided: every other member's collective waits on it), or the
        window left it out and it has been silent since (it was late and went quiet). Dead or frozen,
        most likely; the others would otherwise wait out the heartbeat timeout (or a window per
        exchange) for it, and the operator who set a window asked them not to."""
        super()._sweep()
        if not self.quorum_grace_s:
            return
        heard, silence = self._heard(), self._silence()
        interval = f"three heartbeat intervals: {self._heard_limit_s():g}s"
        for g in [g for g, behind in self._behind.items() if behind and g not in heard]:
            self._fail_group(g, f"missed exchange {min(self._behind[g])}: its quorum formed without this group once "
                                f"the {self.quorum_grace_s:g}s grace window (--quorum-grace) ended, and it has been "
                                f"silent for {silence.get(g, 0.0):.1f}s since ({interval}); it heals into a later exchange")
        for g, q in self._in_flight_members().items():
            if g not in heard and g in silence:
                self._fail_group(g, f"silent for {silence[g]:.1f}s ({interval}) while exchange {q.exchange} (quorum "
                                    f"{q.id}), whose members all wait on it, was in flight: with a grace window "
                                    "(--quorum-grace) the others do not wait out the heartbeat timeout; it heals into "
                                    "a later exchange")

    def _in_flight_members(self) -> dict[int, rounds.Quorum]:
        """Group -> the undecided quorum of this coordinator it is a member of (lock held)."""
        out: dict[int, rounds.Quorum] = {}
        for q, meta in self._quorums.values():
            if q.id not in self._decisions and not meta.get("orphan"):
                out.update({g: q for g in q.groups if g not in self._summaries})
        return out

    def _grace_left(self, exchange: int) -> float:
        """Seconds until the grace window of ``exchange``'s next attempt ends, or until a live group
        it waits for falls silent for three heartbeat intervals (``rounds.window_closed``): a wake-up
        time; infinite without a window, before it starts or before the job's first training commit
        (no window applies then), and once the window passed (the caller's poll and every ask,
        failure and answer wake it then: no busy wait); at least 1 ms."""
        start = self._grace_from.get(exchange)
        if not self.quorum_grace_s or start is None or not self._counts["committed_training"]:
            return float("inf")
        asked, silence, limit = set(self._group_asks(exchange)), self._silence(), self._heard_limit_s()
        left = start + self.quorum_grace_s - self._clock()
        wakes = [limit - silence[g] for g in self._live() if g not in asked and silence.get(g, limit + 1) <= limit]
        return max(min(([left] if left > 0 else []) + wakes, default=float("inf")), 0.001)

    def _majority_asked(self, exchange: int, asks: dict[int, rounds.Ask], heard: set[int]) -> float | None:
        """When the groups asking for ``exchange``'s attempt became a strict majority of the live
        groups still heard from (``heard``) and asking: the start of its grace window (and of the
        wait before a silent member is called stuck); None before (lock held). One group asking
        early starts no clock."""
        start = self._grace_from.get(exchange)
        if start is None and 2 * len(asks) > len(heard | set(asks)):
            start = self._grace_from[exchange] = self._clock()
            while len(self._grace_from) > MAX_WINDOWS_KEPT:
                del self._grace_from[next(iter(self._grace_from))]
        return start
