"""When a group's rounds end by the clock, and how far a healer trails the others: the engine's
timekeeping (``DiLoCo`` owns one ``RoundClock``).

Rounds by time (``TimeRounds(seconds, rounds)``, docs/algorithms.md §6.3): each of P fragments has
its own rounds, staggered as fixed H staggers them (fragment p's first round ends (p + 1)/P of
``seconds`` in). A round's deadline is ``seconds`` after it began: in blocking mode after the
fragment's commit (every group commits together); in overlap, where the previous round was due (a
fixed grid from the start: there is no barrier, and a grid does not drift). A round ends after the
step that ``round_over`` picks for its deadline.

Catching up (rounds of a fixed H): a group that healed started its round only when its state
transfer ended, the others when the exchange it joined committed; until its first launch as a
member it may count the steps it is behind without training them (``steps_behind``).

A group of several ranks passes ``vote``: every rank calls it with its own verdict (an int) and it
returns rank 0's (a broadcast), so every rank acts on the same step.

``RoundTiming`` is the engine's API over its clock (progress, catch-up), which ``DiLoCo`` inherits.
"""

from __future__ import annotations

from collections.abc import Callable

from diloco.engine.events import SyncEvent
from diloco.engine.fragment import Fragment
from diloco.engine.schedule import SyncSchedule, TimeRounds, longest_round, round_over, time_progress


class RoundClock:
    """The round timing of one engine with ``fragments`` fragments. ``time_rounds``: rounds by time,
    or None (fixed H: only the catch-up). ``overlap``: the engine's mode is overlap (no barrier
    at a launch). ``clock``: seconds (``time.monotonic``). ``vote``: see the module doc."""

    def __init__(self, fragments: int, time_rounds: TimeRounds | None, *, overlap: bool,
                 clock: Callable[[], float], vote: Callable[[int], int] | None = None) -> None:
        self.fragments, self.time_rounds, self.overlap = fragments, time_rounds, overlap
        self.clock, self.vote = clock, vote
        self.step_end = clock()  # when the last step ended
        self.origin = self.step_end  # overlap: the grid's start (fragment P-1's first round began then)
        self.step_seconds = 0.0  # moving average of this group's step time (timed rounds, catching up)
        #: when each fragment's current round began (its deadline is ``seconds`` later)
        self.round_start = self.staggered(self.step_end, fragments - 1)
        #: a healer under fixed H until its first launch as a member: (clock time the exchange it
        #: joined committed, inner step then)
        self.catch_up: tuple[float, int] | None = None

    def note_step(self) -> float:
        """The clock now, after a trained step; updates the moving-average step time."""
        now = self.clock()
        took = now - self.step_end
        self.step_seconds = took if self.step_seconds == 0 else 0.5 * self.step_seconds + 0.5 * took
        self.step_end = now
        return now

    def staggered(self, at: float, p: int) -> list[float]:
        """When each fragment's round began, given that fragment p's began ``at``: fragment q's
        ends ``(q - p) mod P`` P-ths of a round after p's. Empty without rounds by time."""
        if self.time_rounds is None:
            return []
        n, seconds = self.fragments, self.time_rounds.seconds
        return [at + ((q - p) % n) * seconds / n - (seconds if (q - p) % n else 0.0) for q in range(n)]

    def due(self, rounds: list[int]) -> list[int]:
        """Rounds by time, after a step: the fragments whose round ends now (``rounds``: each
        fragment's launches so far), the same on every rank."""
        now = self.note_step()
        t = self.time_rounds
        mask = 0
        for p, start in enumerate(self.round_start):
            if rounds[p] < t.rounds and round_over(now, start + t.seconds, self.step_seconds):
                mask |= 1 << p
        if self.vote is not None:
            mask = int(self.vote(mask))
        return [p for p in range(self.fragments) if mask >> p & 1]

    def launched(self, p: int) -> None:
        """Fragment p launched (and, in blocking, committed): its next round begins; a healer
        has caught up."""
        self.catch_up = None
        if self.time_rounds is None:
            return
        self.step_end = self.clock()
        if self.overlap:
            self.round_start[p] += self.time_rounds.seconds
        else:
            self.round_start[p] = self.step_end

    def adopted(self, p: int, r: int, committed_at: float | None, inner_step: int) -> None:
        """A healer joined fragment p's exchange of round r, which committed at ``committed_at``
        (None: unknown): its rounds follow the members' from there, and under fixed H it catches up."""
        if self.time_rounds is not None:
            at = self.step_end if committed_at is None else min(committed_at, self.step_end)
            self.round_start = self.staggered(at, p)
            self.origin = at - (r + (p + 1) / self.fragments) * self.time_rounds.seconds
        elif committed_at is not None:
            self.catch_up, self.step_end = (committed_at, inner_step), self.clock()

    def progress(self, rounds_done: int) -> float:
        """Rounds by time: the job's progress in [0, 1] after ``rounds_done`` rounds of fragment 0.
        Overlap: the time since the grid's start over the job's (``rounds`` rounds of ``seconds``,
        when the last fragment's last round ends), the same on every group at the same moment."""
        t = self.time_rounds
        if self.overlap:
            return min(max(self.clock() - self.origin, 0.0) / (t.rounds * t.seconds), 1.0)
        return time_progress(rounds_done, self.clock() - self.round_start[0], seconds=t.seconds, rounds=t.rounds)

    def steps_behind(self, inner_step: int, next_launch: int) -> int:
        """While catching up: the steps the others made since the commit this group joined, at its
        own step time, less the steps it made; never reaching ``next_launch`` (it trains that
        step). 0 until it has timed a step, and when not catching up (no vote then)."""
        if self.catch_up is None:
            return 0
        committed_at, at_step = self.catch_up
        behind = 0
        if self.step_seconds > 0:
            behind = int((self.clock() - committed_at) / self.step_seconds) - (inner_step - at_step)
            behind = max(0, min(behind, next_launch - inner_step - 1))
        return int(self.vote(behind)) if self.vote is not None else behind


class RoundTiming:
    """The engine's API over its ``round_clock`` (``DiLoCo`` inherits it): progress, rounds by
    time, and a healer's catch-up."""

    round_clock: RoundClock
    time_rounds: TimeRounds | None
    schedule: SyncSchedule
    inner_step: int
    fragments: list[Fragment]
    rounds: list[int]
    next_sync: list[int]
    step: Callable[[], list[SyncEvent]]
    _skipping: bool  # the step counted now was not trained (``skip_step``)

    @property
    def catching_up(self) -> bool:
        """A group that healed into rounds of fixed H, until it launches its first exchange as a
        member: ``steps_behind`` may say to count steps untrained (``skip_step``)."""
        return self.round_clock.catch_up is not None

    def steps_behind(self) -> int:
        """How many inner steps this group trails the others by while ``catching_up``: the members
        started their round when the exchange it joined committed, it only once its state transfer
        ended. The steps they have made since, at this group's own step time, less the steps it
        made; never the steps up to its next launch (it trains at least that one). 0 until it has
        timed a step. In a group of several ranks, rank 0's count (``round_vote``), so every rank
        skips alike; every rank calls it at every step of the catch-up."""
        return self.round_clock.steps_behind(self.inner_step, min(self.next_sync))

    def skip_step(self) -> list[SyncEvent]:
        """Count one inner step this group did not train (``steps_behind``): the schedule moves
        on as for a trained step, and its contributions weigh only the steps it trained."""
        for frag in self.fragments:
            frag.launched_at += 1
        self._skipping = True
        try:
            return self.step()
        finally:
            self._skipping = False

    @property
    def max_round_steps(self) -> int | None:
        """The most inner steps one fragment's exchange can carry under the schedule (the bound of
        a contribution's weight, ``schedule.longest_round``); None when nothing bounds a round."""
        return longest_round(self.schedule)

    def progress(self) -> float:
        """The job's progress in [0, 1]: with time rounds, rounds committed and this round's time
        elapsed (``time_progress``, alike on every group); else inner steps over the schedule's
        total steps (0 without one)."""
        if self.time_rounds is not None:
            return self.round_clock.progress(self.rounds[0])
        total = getattr(self.schedule, "total_steps", None)
        return min(self.inner_step / total, 1.0) if total else 0.0

    @property
    def rounds_done(self) -> bool:
        """Time rounds: every round of every fragment has been launched (the training loop ends)."""
        return self.time_rounds is not None and min(self.rounds) >= self.time_rounds.rounds
