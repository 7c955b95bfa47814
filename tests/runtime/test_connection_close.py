"""Closing a group's connection never waits for a background re-probe whose peer will not answer
(a finished peer group): before, a finished job sat out the whole --timeout at close."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from diloco.exchange.network_plan import BandwidthMonitor
from diloco.runtime.rank.averager_setup import Reprobe
from diloco.runtime.rank.connection import GroupConnection


class _Closable:
    def __init__(self, **attrs) -> None:
        self.closed = False
        self.__dict__.update(attrs)

    def close(self, *args, **kwargs) -> None:
        self.closed = True


def test_close_does_not_wait_for_a_reprobe_in_flight():
    unanswered = threading.Event()  # a probe to a peer that finished: no answer before the deadline

    def measure() -> dict[int, float]:
        unanswered.wait(60.0)
        return {1: 1e6}

    averager = _Closable(exchanges=5)
    monitor = BandwidthMonitor(measure, lambda rates: None)
    reprobe = Reprobe(monitor, averager, every=1)
    transport, client, metrics = _Closable(timeout_s=60.0), _Closable(), _Closable()
    link = GroupConnection(transport=transport, client=client, membership=SimpleNamespace(), averager=averager,
                           reprobe=reprobe, metrics=metrics, group=0, rank=0, group_size=1)
    reprobe.after_step()  # starts the re-probe, which now waits for its peer
    try:
        started = time.monotonic()
        link.close()
        took = time.monotonic() - started
    finally:
        unanswered.set()
    assert took < 10.0, f"close waited {took:.1f} s for a re-probe in flight"
    assert averager.closed and transport.closed and client.closed and metrics.closed
