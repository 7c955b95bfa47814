"""Coordinator over real gRPC on 127.0.0.1 ephemeral ports: joins, auth, validation, reports."""

import re
import threading
import time

import grpc
import pytest
from diloco_helpers import free_port

from diloco.coordinator import CoordinatorClient, CoordinatorError, CoordinatorServer
from diloco.coordinator import coordinator_pb2 as pb
from diloco.coordinator.server import SERVICE


@pytest.fixture
def server():
    srv = CoordinatorServer("127.0.0.1", 0, expected_groups=2, join_timeout_s=10.0)
    srv.start()
    yield srv
    srv.stop(grace_s=0.2)


def data_addr(group: int, rank: int) -> str:
    return f"127.0.0.1:{20000 + 100 * group + rank}"


def join_all(address: str, groups: int, size: int, **client_kwargs):
    """Join every (group, rank) from its own thread; returns {(group, rank): Membership}."""
    results, errors = {}, []

    def one(g: int, r: int) -> None:
        try:
            with CoordinatorClient(address, timeout_s=5.0, **client_kwargs) as c:
                results[(g, r)] = c.join(g, r, size, data_addr(g, r))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(g, r)) for g in range(groups)
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert not errors, errors
    return results


def test_two_groups_of_two_get_identical_membership(server):
    results = join_all(server.address, 2, 2)
    assert len(results) == 4 and len({repr(m) for m in results.values()}) == 1
    m = results[(0, 0)]
    assert m.groups == [0, 1] and m.ring_order == [0, 1] and m.epoch == 1
    assert m.ranks(1) == [data_addr(1, 0), data_addr(1, 1)]
    snap = server.snapshot()
    assert snap["groups"][0] == {"ranks": {0: data_addr(0, 0), 1: data_addr(0, 1)},
                                 "group_size": 2}
    # a restarted rank joining again with the same address gets the same membership at once
    with CoordinatorClient(server.address, timeout_s=5.0) as c:
        assert c.join(1, 0, 2, data_addr(1, 0)) == m
        with pytest.raises(CoordinatorError, match="already joined with address") as info:
            c.join(1, 0, 2, "127.0.0.1:1")
        assert info.value.code == "FAILED_PRECONDITION"


def test_more_concurrent_joins_than_the_minimum_pool():
    # 32 joins block at once; the pool must hold them all, or the quorum never forms
    with CoordinatorServer(expected_groups=4, join_timeout_s=10.0, max_group_size=8) as srv:
        results = join_all(srv.address, 4, 8)
    assert len(results) == 32 and len({repr(m) for m in results.values()}) == 1


def test_join_timeout_names_missing_members():
    with CoordinatorServer(expected_groups=2, join_timeout_s=1.0) as srv:
        with CoordinatorClient(srv.address, timeout_s=5.0) as c:
            start = time.monotonic()
            with pytest.raises(CoordinatorError) as info:
                c.join(0, 0, 2, data_addr(0, 0))
            elapsed = time.monotonic() - start
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert "group 0: ranks [1] of 2; group 1: no rank joined" in str(info.value)
    assert 0.9 < elapsed < 3.0


def test_join_answers_before_the_clients_own_deadline(server):
    with CoordinatorClient(server.address, timeout_s=5.0) as c:
        start = time.monotonic()
        with pytest.raises(CoordinatorError, match="waiting for: group 0: ranks \\[1\\]"):
            c.join(0, 0, 2, data_addr(0, 0), timeout_s=1.5)
    assert time.monotonic() - start < 1.5


def test_unreachable_coordinator_fails_within_timeout():
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(CoordinatorError, match=f"cannot reach coordinator at 127.0.0.1:{port} "
                                               "within 1s"):
        CoordinatorClient(f"127.0.0.1:{port}", timeout_s=1.0)
    assert 0.9 < time.monotonic() - start < 3.0


def test_token_is_required_and_checked():
    with CoordinatorServer(expected_groups=1, token="s3cret", join_timeout_s=5.0) as srv:
        for token, pattern in ((None, "missing authorization"), ("wrong", "wrong coordinator token")):
            with pytest.raises(CoordinatorError, match=pattern) as info:
                CoordinatorClient(srv.address, token=token, timeout_s=5.0)
            assert info.value.code == "UNAUTHENTICATED"
        with pytest.raises(grpc.RpcError) as raw:  # every method checks, not only Ping
            raw_call(srv.address, "Join", pb.JoinRequest(
                group=0, rank=0, group_size=1, address="h:1").SerializeToString())
        assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert srv.snapshot()["groups"] == {}
        with CoordinatorClient(srv.address, token="s3cret", timeout_s=5.0) as c:
            assert c.join(0, 0, 1, data_addr(0, 0)).groups == [0]


def raw_call(address: str, method: str, payload: bytes) -> bytes:
    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=5.0)


@pytest.mark.parametrize("method,payload,pattern", ids=["syntax", "type", "field", "size"], argvalues=[
    ("Join", b"{not protobuf", "Join: JoinRequest: not a valid diloco.coordinator.v1.JoinRequest"),
    ("Join", pb.JoinRequest(group=0, group_size=1, address="h:1").SerializeToString()
     + b"\x12\x01\x30",  # rank sent as the string "0"
     "rank: wrong type on the wire"),
    ("Heartbeat", pb.HeartbeatRequest(group=0, rank=0).SerializeToString(), "missing field.*step"),
    ("ReportSummary", pb.SummaryRequest(group=0, summary=pb.JsonObject(fields=[pb.JsonField(
        key="x", value=pb.JsonValue(string_value="y" * 2_000_000))])).SerializeToString(),
     "the limit is 1048576"),
])
def test_malformed_requests_are_invalid_argument_and_server_keeps_serving(
        server, method, payload, pattern):
    with pytest.raises(grpc.RpcError) as info:
        raw_call(server.address, method, payload)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(pattern, info.value.details())
    assert len(join_all(server.address, 2, 1)) == 2  # still serving


@pytest.mark.parametrize("group,rank,size,code,pattern", [
    (2, 0, 1, "INVALID_ARGUMENT", "group 2 is out of range"),
    (0, 0, 1000, "INVALID_ARGUMENT", "max_group_size"),
])
def test_out_of_range_join_is_rejected(server, group, rank, size, code, pattern):
    with CoordinatorClient(server.address, timeout_s=5.0) as c:
        with pytest.raises(CoordinatorError, match=pattern) as info:
            c.join(group, rank, size, data_addr(0, 0))
    assert info.value.code == code


def test_inconsistent_group_size_and_duplicate_rank_are_rejected(server):
    waiting = CoordinatorClient(server.address, timeout_s=5.0)
    outcome = []
    pending = threading.Thread(target=lambda: outcome.append(pytest.raises(
        CoordinatorError, waiting.join, 0, 0, 2, data_addr(0, 0), timeout_s=3.0).value))
    pending.start()
    try:
        with CoordinatorClient(server.address, timeout_s=5.0) as c:
            deadline = time.monotonic() + 5
            while not server.snapshot()["groups"] and time.monotonic() < deadline:
                time.sleep(0.02)
            with pytest.raises(CoordinatorError, match="joined with group_size 2; rank 1 says "
                                                       "3") as info:
                c.join(0, 1, 3, data_addr(0, 1))
            assert info.value.code == "FAILED_PRECONDITION"
            with pytest.raises(CoordinatorError, match="already joined with address"):
                c.join(0, 0, 2, data_addr(0, 5))  # its first join is still waiting
    finally:
        server.stop(grace_s=0.2)  # releases the waiting join
        pending.join(timeout=5)
        waiting.close()
    assert not pending.is_alive()
    assert len(outcome) == 1 and outcome[0].code in ("UNAVAILABLE", "CANCELLED")


def test_divergence_is_recorded_when_round_hashes_differ(server):
    join_all(server.address, 2, 1)
    with CoordinatorClient(server.address, timeout_s=5.0) as c:
        c.report_round(0, 1, "sha256:aa")
        c.report_round(1, 1, "sha256:aa")
        c.report_round(0, 2, "sha256:bb")
        c.report_round(1, 2, "sha256:cc")
    snap = server.snapshot()
    assert snap["divergence"] == [{"round": 2, "hashes": {0: "sha256:bb", 1: "sha256:cc"}}]
    assert snap["rounds"] == {0: 2, 1: 2}


def test_progress_heartbeat_and_summaries(server):
    join_all(server.address, 2, 1)
    with CoordinatorClient(server.address, timeout_s=5.0) as c:
        c.heartbeat(0, 0, 10)
        c.report_progress(1, 0, {"step": 10, "loss": 3.25, "codec": "int8"})
        with pytest.raises(CoordinatorError, match="group 0 rank 1 has not joined") as info:
            c.heartbeat(0, 1, 10)
        assert info.value.code == "NOT_FOUND"
        timer = threading.Timer(0.3, c.report_summary, args=(1, {"final_loss": 3.0}))
        timer.start()
        c.report_summary(0, {"final_loss": 3.1, "rounds": [1, 2]})
        start = time.monotonic()
        got = server.wait_for_summaries(2, timeout_s=5.0)
        assert 0.1 < time.monotonic() - start < 4.0
        timer.join()
    assert got == {0: {"final_loss": 3.1, "rounds": [1, 2]}, 1: {"final_loss": 3.0}}
    snap = server.snapshot()
    assert snap["progress"][1] == {"step": 10, "loss": 3.25, "codec": "int8"}
    assert snap["steps"] == {0: {0: 10}}


def test_wait_for_summaries_timeout(server):
    with pytest.raises(CoordinatorError, match="no summary yet from groups \\[0, 1\\]"):
        server.wait_for_summaries(1, timeout_s=0.2)


def test_silent_member_is_failed_and_heartbeat_says_so():
    with CoordinatorServer(expected_groups=2, heartbeat_timeout_s=0.3) as srv:
        with CoordinatorClient(srv.address, timeout_s=5.0) as c, CoordinatorClient(srv.address, timeout_s=5.0) as other:
            joined = threading.Thread(target=other.join, args=(1, 0, 1, data_addr(1, 0)))
            joined.start()
            c.join(0, 0, 1, data_addr(0, 0))
            joined.join()
            done = threading.Event()

            def beat() -> None:  # group 1 stays alive (and holds the job's state)
                while not done.wait(0.05):
                    other.heartbeat(1, 0, 1)

            beating = threading.Thread(target=beat)
            beating.start()
            try:
                time.sleep(0.5)
                assert [(f["group"], f["rank"]) for f in srv.snapshot()["failed"]] == [(0, 0)]
                with pytest.raises(CoordinatorError, match="marked failed") as info:
                    c.heartbeat(0, 0, 1)
                assert info.value.code == "FAILED_PRECONDITION"
                c.join(0, 0, 1, data_addr(0, 0))
                c.heartbeat(0, 0, 1)
                assert srv.snapshot()["failed"] == []
            finally:
                done.set()
                beating.join()


def test_stop_releases_waiting_joins_promptly():
    srv = CoordinatorServer(expected_groups=2, join_timeout_s=30.0)
    srv.start()
    errors = []
    c = CoordinatorClient(srv.address, timeout_s=5.0)

    def join() -> None:
        try:
            c.join(0, 0, 1, data_addr(0, 0))
        except CoordinatorError as exc:
            errors.append(exc)

    t = threading.Thread(target=join)
    t.start()
    time.sleep(0.3)
    start = time.monotonic()
    srv.stop(grace_s=1.0)
    t.join(timeout=5)
    c.close()
    assert not t.is_alive() and time.monotonic() - start < 3.0
    assert len(errors) == 1 and errors[0].code in ("UNAVAILABLE", "CANCELLED")


def test_client_validates_before_sending(server):
    with CoordinatorClient(server.address, timeout_s=5.0) as c:
        with pytest.raises(CoordinatorError, match="invalid ReportProgress request") as info:
            c.report_progress(0, 0, {"nested": {"no": 1}})
        assert info.value.code is None
        with pytest.raises(CoordinatorError, match="wildcard"):
            c.join(0, 0, 1, "0.0.0.0:7000")
    assert server.snapshot()["groups"] == {}
