"""A coordinator's state on a fake clock with one-rank groups asking and voting from threads: the
helpers of the coordinator's stateful rule tests (no gRPC, no processes)."""

from __future__ import annotations

import threading

from diloco.coordinator.messages import CommitRequest, JoinRequest, QuorumRequest
from diloco.coordinator.quorum import QuorumError
from diloco.coordinator.state import CoordinatorState


class FakeClock:
    """Seconds that move only when a test moves them (``now``)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def formed(groups: int, **kwargs):
    """A CoordinatorState (``kwargs``) on a FakeClock whose ``groups`` one-rank groups all joined."""
    clock = FakeClock()
    state = CoordinatorState(groups, clock=clock, **kwargs)
    threads = [threading.Thread(target=state.join, args=(JoinRequest(g, 0, 1, f"10.0.{g}.0:7000"),),
                                kwargs={"deadline": 1e9}) for g in range(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    assert state.snapshot()["complete"]
    return state, clock


def ask_in_thread(state, group: int, exchange: int, out: dict, **fields):
    """Group ``group`` (one rank) asks for ``exchange`` in a thread; its answer or error lands in ``out``."""

    def run() -> None:
        try:
            out[group] = state.quorum(QuorumRequest(group, 0, "", exchange, **{"tag": f"f0/r{exchange}", "numel": 4,
                                                                             "weight": 1.0, **fields}), deadline=1e9)
        except QuorumError as e:
            out[group] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def run_exchange(state, groups, exchange: int, got: dict | None = None) -> dict:
    """Every group of ``groups`` asks for ``exchange`` and votes yes; returns the answers."""
    got = {} if got is None else got
    for t in [ask_in_thread(state, g, exchange, got) for g in groups]:
        t.join(timeout=5)
    vote(state, got, groups)
    return got


def vote(state, got: dict, groups, ok: bool = True) -> None:
    """Every group of ``groups`` votes ``ok`` on the quorum it got (``got``), from threads."""
    votes = [threading.Thread(target=state.commit, args=(CommitRequest(g, 0, "", got[g].id, got[g].exchange,
                                                                       tuple(got[g].members), ok, ""),),
                              kwargs={"deadline": 1e9}) for g in groups]
    for t in votes:
        t.start()
    for t in votes:
        t.join(timeout=5)
