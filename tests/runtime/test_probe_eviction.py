"""A rank's first bandwidth probe gives up as soon as the coordinator tells its group to leave.

Found in the Kubernetes replay (tests/ops/test_ops_replay.py): a group pod started just before the
coordinator declared the job lost joined it as a healer and probed the other group's new pod, which
then exited with the coordinator. Its probe waited for an answer until --timeout (120-180 s), silent,
while its heartbeats had long learnt that the restarted coordinator no longer knew it."""

from __future__ import annotations

import threading
import time

import pytest

from diloco.coordinator import CoordinatorError
from diloco.coordinator.membership import Membership
from diloco.exchange.heartbeat import GroupEvicted
from diloco.job.config import TransportConfig
from diloco.runtime.rank import averager_setup
from transport import TcpTransport

SECRET = b"probe-eviction-test-secret-01234"
HEARTBEAT_TIMEOUT_S = 0.5  # a heartbeat every 0.1 s


class _Coordinator:
    """A coordinator client whose heartbeats answer ``heartbeat_error`` (after ``quiet_s``)."""

    def __init__(self, heartbeat_error: CoordinatorError, quiet_s: float = 0.3) -> None:
        self.heartbeat_error, self.since = heartbeat_error, time.monotonic() + quiet_s
        self.joins: list[int] = []
        self.reported: list[dict] = []

    def heartbeat(self, *args, **kwargs) -> str:
        if time.monotonic() >= self.since:
            raise self.heartbeat_error
        return ""

    def join(self, group, rank, group_size, address, *, incarnation="", exchange=-1):
        self.joins.append(exchange)

    def report_bandwidth(self, group, rank, rates) -> None:
        self.reported.append(rates)


@pytest.mark.parametrize("error, says", [
    (CoordinatorError("Heartbeat: group 1 was declared failed", "FAILED_PRECONDITION"), "declared failed"),
    (CoordinatorError("Heartbeat: group 1 rank 0 has not joined", "NOT_FOUND"), "restart it to join the job anew"),
])
def test_the_first_probe_of_a_healer_ends_when_the_coordinator_tells_its_group_to_leave(monkeypatch, error, says):
    """The probe's peer never answers (it exited); the coordinator says the group is out (declared
    failed), or it restarted and no longer knows this healer: connect's probe raises GroupEvicted
    (exit 75: restart and join anew) within a few heartbeats, not at the probe's deadline, and the
    averager it built stops heartbeating."""
    unanswered = threading.Event()
    monkeypatch.setattr(averager_setup, "measure_rates", lambda *a, **kw: unanswered.wait(60.0) or {0: 1e6})
    client = _Coordinator(error)
    settings = TransportConfig(host="127.0.0.1", timeout_s=60.0, probe_bytes=4096)
    with TcpTransport("127.0.0.1", 0, secret=SECRET, timeout_s=5.0) as t:
        membership = Membership(epoch=1, members={0: ("127.0.0.1:1",), 1: (t.address,)}, ring=(0, 1), heal=True)
        started = time.monotonic()
        try:
            with pytest.raises(GroupEvicted, match=says) as info:
                averager_setup.make_averager(settings, t, membership, client, 1, 0, "cpu", incarnation="again",
                                             heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
        finally:
            unanswered.set()
        took = time.monotonic() - started
    assert took < 5.0, f"the probe held the rank {took:.1f} s after its group was told to leave: {info.value}"
    assert client.reported == [] and client.joins == []  # nothing reported, no rejoin as a member
    heartbeats = [th for th in threading.enumerate() if th.name == "heartbeat[1/0]"]
    for th in heartbeats:
        th.join(2.0)
    assert not any(th.is_alive() for th in heartbeats), "the averager was left heartbeating"


def test_unless_evicted_returns_the_work_or_raises_its_error_while_the_group_stays():
    class Staying:
        evicted, evicted_reason = threading.Event(), None

    assert averager_setup.unless_evicted(lambda: {1: 2.5e6}, Staying()) == {1: 2.5e6}

    def fails():
        raise ConnectionResetError("probe to 10.0.0.2:29500 failed: reset")

    with pytest.raises(ConnectionResetError, match="reset"):
        averager_setup.unless_evicted(fails, Staying())
