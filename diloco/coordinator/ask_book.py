"""The quorum requests that wait for an answer, and their answers.

One answer per ask: a rank's request for exchange E (under its group's current incarnation, which
the caller checks) gets one answer, and every call waiting on that ask receives it. A second call
with the same request (a retry whose first call is still waiting) waits with the first; a second
call for the same group, rank and exchange with *other* fields is refused: it is not that rank
asking again. So no caller takes another's answer, and no caller rewrites another's request.

Not thread-safe by itself: ``RoundState`` uses it under its lock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .messages import QuorumRequest
from .quorum import QuorumError

Key = tuple[int, int, int]  # (group, rank, exchange asked for)
Answer = tuple[str, Any]  # (kind, value): ("quorum", id), ("evicted", why), ("catch_up", id) ...


class AskBook:
    """Asks by exchange, group and rank (``asks``), and the answers handed to their callers."""

    def __init__(self) -> None:
        #: exchange -> group -> rank -> the request still waiting for its answer
        self.asks: dict[int, dict[int, dict[int, QuorumRequest]]] = {}
        self._generation: dict[Key, int] = {}  # how many asks this key had; an answer names the one it answers
        self._answers: dict[Key, tuple[int, Answer]] = {}
        self._waiters: dict[Key, int] = {}

    def register(self, req: QuorumRequest) -> tuple[int, bool]:
        """Record ``req``, or join the wait of the same request still waiting; returns (the ask's
        generation, whether it is new). Raises QuorumError (INVALID_ARGUMENT) for another request
        under a key whose ask is still waiting."""
        key = (req.group, req.rank, req.exchange)
        pending = self.asks.get(req.exchange, {}).get(req.group, {}).get(req.rank)
        if pending is not None and self._waiters.get(key, 0) > 0:
            if dataclasses.replace(pending, retry=req.retry) != req:
                raise QuorumError("INVALID_ARGUMENT",
                                  f"group {req.group} rank {req.rank} already asks for exchange {req.exchange} with "
                                  "other fields: a second process is using this group's credential")
            return self._generation[key], False
        generation = self._generation.get(key, 0) + 1
        self._generation[key] = generation
        self._answers.pop(key, None)
        self.asks.setdefault(req.exchange, {}).setdefault(req.group, {})[req.rank] = req
        return generation, True

    def answer(self, group: int, ranks: dict[int, QuorumRequest], exchange: int, answer: Answer) -> None:
        """Answer the asks of ``group``'s ``ranks`` for ``exchange`` (already taken out of ``asks``)."""
        for r in ranks:
            key = (group, r, exchange)
            self._answers[key] = (self._generation.get(key, 0), answer)

    def answered(self, key: Key, generation: int) -> Answer | None:
        """The answer to ask ``generation`` of ``key``, or None while it has none."""
        got = self._answers.get(key)
        return got[1] if got is not None and got[0] == generation else None

    def enter(self, key: Key) -> None:
        """A call starts waiting on ``key``'s ask."""
        self._waiters[key] = self._waiters.get(key, 0) + 1

    def leave(self, key: Key, generation: int) -> None:
        """A call stops waiting on ask ``generation`` of ``key`` (answered, or given up). The last
        one to leave clears it: the answer, or an ask nobody waits for any more (its caller went
        away before the quorum formed: it asks again)."""
        left = self._waiters.get(key, 0) - 1
        if left > 0:
            self._waiters[key] = left
            return
        self._waiters.pop(key, None)
        if self._generation.get(key) != generation:
            return
        group, rank, exchange = key
        self._answers.pop(key, None)
        self._generation.pop(key, None)
        by_group = self.asks.get(exchange, {})
        by_group.get(group, {}).pop(rank, None)
        if group in by_group and not by_group[group]:
            del by_group[group]

    def take(self, exchange: int, group: int) -> dict[int, QuorumRequest]:
        """Take ``group``'s waiting asks for ``exchange`` out of ``asks`` (to answer them)."""
        return self.asks.get(exchange, {}).pop(group, {})

    def exchanges(self) -> list[int]:
        """The exchanges some group asks for, in order (HEAL, -1, first)."""
        for e in [e for e, by_group in self.asks.items() if not by_group]:
            del self.asks[e]
        return sorted(self.asks)
