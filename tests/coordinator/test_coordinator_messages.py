"""Wire messages: round trips and strict validation of untrusted protobuf bytes."""

import math

import pytest

from diloco.coordinator import coordinator_pb2 as pb
from diloco.coordinator.messages import (
    MAX_SUMMARY_BYTES, Ack, HeartbeatRequest, JoinRequest, JoinResponse, MessageError,
    Ping, ProgressRequest, RoundRequest, SummaryRequest, check_address)


@pytest.mark.parametrize("message", [
    JoinRequest(1, 1, 2, "10.0.0.1:7000"),
    JoinResponse(1, {0: ("h:1", "h:2"), 1: ("[::1]:3",)}, (1, 0)),
    HeartbeatRequest(0, 0, 12),
    ProgressRequest(0, 1, {"step": 3, "loss": 2.5, "codec": "int8", "healing": False}),
    RoundRequest(1, 7, "sha256:abc"),
    SummaryRequest(0, {"a": [1, 2.5, None, {"b": "c"}], "ok": True}),
    Ack(0),
    Ping(),
])
def test_round_trip(message):
    assert type(message).decode(message.encode()) == message


def test_nan_loss_is_reported_not_refused():
    data = ProgressRequest(0, 0, {"loss": float("nan")}).encode()
    assert math.isnan(ProgressRequest.decode(data).progress["loss"])


def join(**fields) -> bytes:
    """A JoinRequest on the wire with exactly these fields set (no validation on this side)."""
    return pb.JoinRequest(**fields).SerializeToString()


OK = {"group": 0, "rank": 0, "group_size": 1, "address": "h:1"}


@pytest.mark.parametrize("data,pattern", [
    (b"{not json", "not a valid diloco.coordinator.v1.JoinRequest message"),
    (b"\x22\x02\xff\xfe", "(?i)not a valid .*utf-8"),  # address = 2 bytes that are not UTF-8
    (join(group=0, rank=0, group_size=1), "missing field.*address"),
    (join(**OK) + b"\x98\x06\x01", "unknown field.*99"),  # field 99 = 1
    (join(rank=0, group_size=1, address="h:1") + b"\x0a\x01\x30",  # group sent as the string "0"
     "group: wrong type on the wire"),
    (join(**{**OK, "group": 2**62}), "group: 4611686018427387904 is out of range"),
    (join(**{**OK, "rank": 1}), r"rank: 1 is out of range"),
    (join(**{**OK, "group_size": 0}), "group_size: 0 is out"),
    (join(**{**OK, "address": "h"}), "is not host:port"),
    (join(**{**OK, "address": "h:70000"}), "port 70000"),
    (join(**{**OK, "address": "0.0.0.0:5"}), "wildcard"),
])
def test_join_request_rejects(data, pattern):
    with pytest.raises(MessageError, match=pattern):
        JoinRequest.decode(data)


def test_unset_optional_fields_take_the_dataclass_defaults():
    assert JoinRequest.decode(join(**OK)) == JoinRequest(0, 0, 1, "h:1", incarnation="", exchange=-1)
    assert JoinRequest.decode(join(**OK, exchange=0)).exchange == 0  # set to 0 is not unset


@pytest.mark.parametrize("progress,pattern", [
    ({"step": {"nested": 1}}, "expected a number, bool or string, got dict"),
    ({"step": [1]}, "got list"),
    ({"bad key": 1}, "characters outside"),
    ({"k": "x" * 300}, "string longer than 256"),
    ({f"k{i}": i for i in range(65)}, "65 keys"),
])
def test_progress_rejects(progress, pattern):
    with pytest.raises(MessageError, match=pattern):
        ProgressRequest.decode(ProgressRequest(0, 0, progress).to_pb().SerializeToString())


def summary_bytes(group: int, summary) -> bytes:
    return SummaryRequest(group, summary).to_pb().SerializeToString()


def test_summary_limits():
    deep: dict = {}
    node = deep
    for _ in range(10):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(MessageError, match="nested deeper than 8"):
        SummaryRequest.decode(summary_bytes(0, deep))
    big = summary_bytes(0, {"blob": "x" * MAX_SUMMARY_BYTES})
    with pytest.raises(MessageError, match="the limit is 1048576"):
        SummaryRequest.decode(big)
    with pytest.raises(MessageError, match="missing field.*summary"):
        SummaryRequest.decode(pb.SummaryRequest(group=0).SerializeToString())


def test_other_requests_are_limited_to_64_kib():
    data = RoundRequest(0, 1, "h" * 70_000).to_pb().SerializeToString()
    with pytest.raises(MessageError, match="the limit is 65536"):
        RoundRequest.decode(data)


def test_round_hash_must_be_printable_without_spaces():
    with pytest.raises(MessageError, match="param_hash"):
        RoundRequest.decode(RoundRequest(0, 1, "a b").to_pb().SerializeToString())


def test_join_response_ring_must_be_permutation():
    with pytest.raises(MessageError, match="not a permutation"):
        JoinResponse.decode(JoinResponse(1, {0: ("h:1",)}, (0, 1)).to_pb().SerializeToString())
    with pytest.raises(MessageError, match="not a group id"):
        JoinResponse.decode(JoinResponse(1, {-1: ("h:1",)}, (-1,)).to_pb().SerializeToString())


def test_encode_refuses_values_json_cannot_carry():
    with pytest.raises(MessageError, match="cannot encode"):
        ProgressRequest(0, 0, {"x": object()}).encode()  # type: ignore[dict-item]
    with pytest.raises(MessageError, match="got null"):
        ProgressRequest(0, 0, {"x": None}).encode()  # type: ignore[dict-item]


def test_check_address_accepts_ipv6_and_names():
    assert check_address("[fe80::1]:80") == "[fe80::1]:80"
    assert check_address("worker-0.svc.cluster.local:29500")
    with pytest.raises(MessageError, match="wildcard"):
        check_address("[::]:80")
