"""Test scaffolding shared by the diloco tests: simulated groups in threads, a static ring."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def run_in_threads(work: Callable[[int], None], n: int, timeout_s: float = 120.0) -> None:
    """Run ``work(i)`` for i in 0..n-1 in threads (one per simulated group); re-raise failures."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a simulated group did not finish"
    assert not errors, errors


def build_in_threads(make: Callable[[int], T], n: int, timeout_s: float = 120.0) -> list[T]:
    """``[make(i) for i in range(n)]`` with each call in its own thread: engines agree on their
    initial parameters with the other groups while they are built, so they must be built at once."""
    out: list = [None] * n

    def work(i: int) -> None:
        out[i] = make(i)

    run_in_threads(work, n, timeout_s)
    return out


class StaticRing:
    """Membership of single-rank groups, in the shape the averager reads."""

    def __init__(self, addresses: list[str]) -> None:
        self.groups = list(range(len(addresses)))
        self.ring_order = list(self.groups)
        self._addresses = addresses

    def ranks(self, group: int) -> list[str]:
        return [self._addresses[group]]
