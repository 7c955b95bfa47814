"""The coordinator stays responsive under call floods and slow clients (limits.py, server.py)."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import grpc
import pytest

from diloco.coordinator import CoordinatorClient, CoordinatorServer
from diloco.coordinator.credentials import group_token
from diloco.coordinator.limits import CallLimits, Deadlines
from diloco.coordinator.messages import SERVICE, Ack, HeartbeatRequest, HeartbeatResponse, JoinRequest, Ping

TOKEN = "job-token-for-limit-tests"


def test_call_limits_count_per_caller_and_overall() -> None:
    lim = CallLimits(max_blocking=3, max_blocking_per_caller=2, max_quick=1, max_quick_per_caller=1)
    assert lim.enter(True, "group 0") is None and lim.enter(True, "group 0") is None
    assert "group 0 already has 2 blocking calls" in lim.enter(True, "group 0")
    assert lim.enter(True, "group 1") is None
    assert "3 blocking calls already in progress" in lim.enter(True, "group 2")
    assert lim.enter(False, "group 2") is None  # quick calls have their own slots
    assert "1 quick calls already in progress" in lim.enter(False, "group 3")
    lim.leave(True, "group 0")
    assert lim.enter(True, "group 2") is None and lim.in_progress(True) == 3
    assert lim.rejected == 3 and lim.peak[True] == 3
    with pytest.raises(ValueError, match="max_quick_calls"):
        CallLimits(1, 1, 0, 1)


def test_deadlines_fire_once_unless_disarmed() -> None:
    d = Deadlines()
    fired: list[str] = []
    try:
        d.arm(time.monotonic() + 0.1, lambda: fired.append("a"))
        b = d.arm(time.monotonic() + 0.1, lambda: fired.append("b"))
        assert d.disarm(b)
        late = d.arm(time.monotonic() + 5, lambda: fired.append("late"))
        time.sleep(0.4)
        assert fired == ["a"] and d.fired == 1
        assert d.disarm(late)
    finally:
        d.close()


def _wait(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class PingProbe:
    """Pings every 50 ms from its own client while the block runs; the slowest answer."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.client = CoordinatorClient(address, token=token, timeout_s=5.0)
        self.worst = 0.0
        self.errors: list[Exception] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            start = time.monotonic()
            try:
                self.client._call("Ping", Ping(), Ack, timeout_s=5.0)
            except Exception as e:  # noqa: BLE001 - asserted below
                self.errors.append(e)
            self.worst = max(self.worst, time.monotonic() - start)

    def __enter__(self) -> "PingProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()


def test_a_join_flood_is_capped_and_ping_and_other_groups_still_answer() -> None:
    with CoordinatorServer("127.0.0.1", 0, expected_groups=2, token=TOKEN, join_timeout_s=20.0, max_group_size=4,
                           max_blocking_per_caller=4, max_blocking_calls=12) as srv, \
            PingProbe(srv.address, TOKEN) as probe:
        evil = (("authorization", f"Bearer {group_token(TOKEN, 1)}"),)
        channel = grpc.insecure_channel(srv.address)
        join = channel.unary_unary(f"/{SERVICE}/Join")
        start = time.monotonic()
        # 30 blocking joins of group 1 (ranks 0-2 of a 4-rank group: they wait for rank 3)
        flood = [join.future(JoinRequest(1, i % 3, 4, f"127.0.0.9:{100 + i % 3}").encode(), metadata=evil, timeout=20)
                 for i in range(30)]
        time.sleep(1.0)
        refused = [f for f in flood if f.done() and f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(refused) == 26 and all(f.done() for f in refused)
        assert "group 1 already has 4 blocking calls" in refused[0].details()
        assert srv.call_stats["blocking_now"] == 4
        # group 0 still gets a slot: its join waits for the membership like any join
        honest: dict = {}

        def join_as(g: int, r: int, n: int) -> None:
            with CoordinatorClient(srv.address, token=group_token(TOKEN, g), timeout_s=20) as c:
                honest[(g, r)] = c.join(g, r, n, f"127.0.0.9:{100 + r}" if g else "127.0.0.1:3000")

        first = threading.Thread(target=join_as, args=(0, 0, 1))
        first.start()
        assert _wait(lambda: srv.call_stats["blocking_now"] == 5, 3.0), srv.call_stats
        # the flooder lets go; then group 1's four ranks join and the membership forms
        for f in flood:
            f.cancel()
        assert _wait(lambda: srv.call_stats["blocking_now"] == 1, 3.0), srv.call_stats
        rest = [threading.Thread(target=join_as, args=(1, r, 4)) for r in range(4)]
        for t in rest:
            t.start()
        for t in [first, *rest]:
            t.join(20)
        assert len(honest) == 5 and honest[(0, 0)].groups == [0, 1]
        assert time.monotonic() - start < 10
        channel.close()
    assert not probe.errors and probe.worst < 1.0, (probe.worst, probe.errors[:2])


def test_slow_clients_are_cut_off_and_cannot_take_other_callers_slots() -> None:
    def never() -> Iterator[bytes]:
        hold.wait(20)
        return
        yield b""

    hold = threading.Event()
    with CoordinatorServer("127.0.0.1", 0, expected_groups=2, token=TOKEN, request_timeout_s=1.0,
                           max_quick_calls=8, max_quick_per_caller=3) as srv, PingProbe(srv.address, TOKEN) as probe:
        evil = (("authorization", f"Bearer {group_token(TOKEN, 1)}"),)
        channel = grpc.insecure_channel(srv.address)
        start = time.monotonic()
        slow = [channel.stream_unary(f"/{SERVICE}/Heartbeat").future(never(), metadata=evil, timeout=20)
                for _ in range(10)]
        time.sleep(0.3)
        with CoordinatorClient(srv.address, token=group_token(TOKEN, 0), timeout_s=5.0) as other:
            t = time.monotonic()
            with pytest.raises(Exception, match="NOT_FOUND"):  # answered (group 0 never joined), not queued
                other.heartbeat(0, 0, 1)
            assert time.monotonic() - t < 1.0
        codes = []
        for f in slow:
            try:
                f.result(timeout=10)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
        took = time.monotonic() - start
        hold.set()
        channel.close()
        assert codes.count("CANCELLED") == 3 and codes.count("RESOURCE_EXHAUSTED") == 7, codes
        assert 0.9 < took < 3.0, f"slow requests lived {took:.2f} s, request_timeout_s=1"
        assert srv.call_stats["request_timeouts"] == 3
    assert not probe.errors and probe.worst < 1.0


def test_the_client_retries_while_the_coordinator_is_busy() -> None:
    with CoordinatorServer("127.0.0.1", 0, expected_groups=1, join_timeout_s=5.0, max_quick_calls=1,
                           max_quick_per_caller=1) as srv:
        with CoordinatorClient(srv.address, timeout_s=10.0) as c:
            c.join(0, 0, 1, "127.0.0.1:4000")
            errors: list[Exception] = []

            def beat() -> None:
                try:
                    for step in range(10):
                        c._call("Heartbeat", HeartbeatRequest(0, 0, step), HeartbeatResponse)
                except Exception as e:  # noqa: BLE001 - asserted below
                    errors.append(e)

            threads = [threading.Thread(target=beat) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        assert not errors, errors[:2]
        assert srv.call_stats["quick_peak"] == 1
