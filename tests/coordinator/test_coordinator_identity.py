"""Per-group credentials at the coordinator: a group acts only for itself (credentials.py, server.py)."""

from __future__ import annotations

import threading

import grpc
import pytest

from diloco.coordinator import CoordinatorClient, CoordinatorError, CoordinatorServer
from diloco.coordinator import credentials
from diloco.coordinator.credentials import for_group, group_token, parse_group_token
from diloco.coordinator.messages import (SERVICE, Ack, HeartbeatRequest, HeartbeatResponse, JoinRequest, OfferQuery,
                                         RoundRequest, StateOffer, StopRequest, SummaryRequest)

TOKEN = "job-token-for-identity-tests"


def addr(g: int, r: int = 0) -> str:
    return f"127.0.0.1:{21000 + 10 * g + r}"


@pytest.fixture
def srv():
    server = CoordinatorServer("127.0.0.1", 0, expected_groups=2, token=TOKEN, join_timeout_s=10.0)
    server.start()
    yield server
    server.stop(grace_s=0.2)


def _join_both(address: str, token_of) -> dict:
    out: dict = {}

    def one(g: int) -> None:
        with CoordinatorClient(address, token=token_of(g), timeout_s=5.0) as c:
            out[g] = c.join(g, 0, 1, addr(g))

    threads = [threading.Thread(target=one, args=(g,)) for g in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return out


def test_group_tokens_are_derived_and_parsed() -> None:
    t0 = group_token(TOKEN, 0)
    assert parse_group_token(t0) == 0 and t0 != group_token(TOKEN, 1) != group_token("other", 1)
    assert parse_group_token(TOKEN) is None and parse_group_token("g1.zz") is None
    assert for_group(TOKEN, 3) == group_token(TOKEN, 3) and for_group(t0, 0) == t0 and for_group(None, 0) is None
    with pytest.raises(ValueError, match="group 0's, not group 1's"):
        for_group(t0, 1)
    assert credentials.check(TOKEN, t0) == credentials.Caller(admin=False, group=0, verified=True)
    assert credentials.check(TOKEN, TOKEN).admin
    assert credentials.check(TOKEN, group_token("another-job", 0)) is None


def test_groups_join_with_their_own_credentials_only(srv) -> None:
    members = _join_both(srv.address, lambda g: group_token(TOKEN, g))
    assert members[0] == members[1] and members[0].groups == [0, 1]


def test_a_group_credential_cannot_act_for_another_group(srv) -> None:
    _join_both(srv.address, lambda g: group_token(TOKEN, g))
    evil = CoordinatorClient(srv.address, token=group_token(TOKEN, 1), timeout_s=5.0)
    attempts = {
        "Heartbeat": (HeartbeatRequest(0, 0, 5), HeartbeatResponse),
        "ReportRound": (RoundRequest(0, 1, "forged"), Ack),
        "ReportSummary": (SummaryRequest(0, {"forged": True}), Ack),
        "OfferState": (StateOffer("q-1", 0, 0, 1, 0, 10, "ab" * 32), Ack),
        "WaitOffer": (OfferQuery("q-1", 0, 0), StateOffer),
        "RequestStop": (StopRequest("forged"), Ack),
    }
    for name, (request, reply) in attempts.items():
        with pytest.raises(CoordinatorError) as info:
            evil._call(name, request, reply)
        assert info.value.code == "PERMISSION_DENIED", (name, info.value)
    with pytest.raises(CoordinatorError, match="acts only for itself") as info:
        evil.join(0, 0, 1, "127.0.0.1:9")  # the squatter of the issue
    snap = srv.snapshot()
    assert snap["summaries"] == {} and snap["rounds"] == {} and snap["rounds_state"]["stop"] is None
    assert snap["groups"][0]["ranks"] == {0: addr(0)}
    # its own group's calls go through
    evil.heartbeat(1, 0, 5)
    evil.report_round(1, 1, "h1")
    assert srv.snapshot()["rounds"] == {1: 1}
    assert srv.call_stats["denied"] == len(attempts) + 1
    evil.close()


def test_the_job_token_acts_for_every_group_and_stops_the_job(srv) -> None:
    _join_both(srv.address, lambda g: TOKEN)  # the client sends each group's derived credential
    with CoordinatorClient(srv.address, token=TOKEN, timeout_s=5.0) as admin:
        admin.report_round(0, 1, "h")
        admin.request_stop("operator")
    assert srv.snapshot()["rounds_state"]["stop"] == "operator"


def test_wrong_or_foreign_credentials_are_unauthenticated(srv) -> None:
    for token in ("nope", group_token("another-job", 0), group_token(TOKEN, 0)[:-1] + "0"):
        with pytest.raises(CoordinatorError) as info:
            CoordinatorClient(srv.address, token=token, timeout_s=5.0)
        assert info.value.code == "UNAUTHENTICATED"
    with grpc.insecure_channel(srv.address) as ch:  # every method, not only Ping
        with pytest.raises(grpc.RpcError) as raw:
            ch.unary_unary(f"/{SERVICE}/Join")(JoinRequest(0, 0, 1, addr(0)).encode(), timeout=5)
    assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert srv.snapshot()["groups"] == {}


def test_without_a_token_the_named_group_must_match_the_request() -> None:
    with CoordinatorServer("127.0.0.1", 0, expected_groups=1, join_timeout_s=5.0) as srv:
        with grpc.insecure_channel(srv.address) as ch:
            with pytest.raises(grpc.RpcError) as raw:
                ch.unary_unary(f"/{SERVICE}/Join")(JoinRequest(0, 0, 1, addr(0)).encode(),
                                                     metadata=(("diloco-group", "3"),), timeout=5)
        assert raw.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with CoordinatorClient(srv.address, timeout_s=5.0) as c:  # names its group itself
            assert c.join(0, 0, 1, addr(0)).groups == [0]
