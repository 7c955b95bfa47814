"""The coordinator's protocol as a schema (coordinator.proto) and its security: the committed
generated code is current, every message survives the wire, bad fields are INVALID_ARGUMENT
through a real server, mutual TLS admits only the right certificates, and a coordinator that
other machines can reach refuses to start without TLS and a token unless told otherwise."""

from __future__ import annotations

import importlib.util
import ipaddress
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from diloco import cli
from diloco.job.config import TransportConfig
from diloco.runtime.rank.endpoint import coordinator_tls
from diloco.coordinator import CoordinatorClient, CoordinatorError, CoordinatorServer, protogen
from diloco.coordinator import coordinator_pb2 as pb
from diloco.coordinator.messages import (
    RPCS, SERVICE, Ack, BandwidthRequest, CommitRequest, CommitResponse, HeartbeatRequest, HeartbeatResponse,
    JoinRequest, JoinResponse, Message, MessageError, OfferQuery, Ping, PlanRequest, PlanResponse, ProgressRequest,
    QuorumRequest, QuorumResponse, RoundRequest, StateOffer, StopRequest, SummaryRequest)
from transport.certs import write_pki
from transport.tls import TlsConfig

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"
REFUSED_S = 1.0  # how long a client waits before it gives up on a coordinator that refuses it
HAVE_GRPC_TOOLS = importlib.util.find_spec("grpc_tools") is not None
needs_grpc_tools = pytest.mark.skipif(not HAVE_GRPC_TOOLS,
                                      reason="grpcio-tools (the dev extra) is not installed: cannot regenerate")


# --- the generated code -------------------------------------------------------------------------

@needs_grpc_tools
def test_committed_generated_code_is_current():
    old, note = protogen.stale()
    assert old == [], f"stale {old}: run python -m diloco.coordinator.protogen ({note or 'same protoc'})"


@needs_grpc_tools
def test_stale_check_notices_a_changed_schema(tmp_path, monkeypatch):
    for rel in (protogen.PROTO, *protogen.OUTPUTS):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    monkeypatch.setattr(protogen, "ROOT", tmp_path)
    assert protogen.stale() == ([], None)
    pb2 = tmp_path / protogen.OUTPUTS[0]
    # another protoc version (another header): only the schema is compared, and it is the same
    pb2.write_text(re.sub(r"Protobuf Python Version: \S+", "Protobuf Python Version: 7.0.0", pb2.read_text()))
    old, note = protogen.stale()
    assert old == [] and "compared the schema only" in note
    proto = tmp_path / protogen.PROTO
    proto.write_text(proto.read_text().replace("message StopRequest {", "message StopRequest {\n  int64 x = 9;"))
    assert protogen.stale()[0] == [protogen.OUTPUTS[0]]  # the schema changed: stale in either mode


def test_generated_code_fits_the_declared_protobuf_range():
    tomllib = pytest.importorskip("tomllib")
    specifiers = pytest.importorskip("packaging.specifiers")
    import google.protobuf

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"protobuf\b", d))
    allowed = specifiers.SpecifierSet(spec[len("protobuf"):])
    made_for = protogen.gencode_version((ROOT / protogen.OUTPUTS[0]).read_text())
    major = int(made_for.split(".")[0])
    assert made_for in allowed, f"{spec} admits runtimes older than the gencode {made_for}"
    assert f"{major + 1}.0.0" not in allowed, f"{spec} admits the next major version"
    assert google.protobuf.__version__ in allowed  # this test run's runtime


def test_service_has_every_rpc_with_its_message_types():
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    assert SERVICE == "diloco.coordinator.v1.Coordinator" == service.full_name
    assert sorted(RPCS) == sorted(["Ping", "Join", "Heartbeat", "ReportProgress", "ReportRound",
                                   "ReportSummary", "ReportBandwidth", "GetPlan", "Quorum", "Commit",
                                   "OfferState", "WaitOffer", "RequestStop"])
    for method in service.methods:
        request, reply = RPCS[method.name]
        assert request.PB.DESCRIPTOR.full_name == method.input_type.full_name
        assert reply.PB.DESCRIPTOR.full_name == method.output_type.full_name


# --- every message over the wire ----------------------------------------------------------------

DIGEST = "ab" * 32
MESSAGES = [
    Ping(),
    Ack(0),
    JoinRequest(3, 1, 2, "[fe80::1]:7000", incarnation="00ff", exchange=-1),
    JoinRequest(0, 0, 1, "worker-0.svc:29500", exchange=12),
    JoinResponse(2, {0: ("h:1", "h:2"), 1: ("[::1]:3",)}, (1, 0), heal=True),
    HeartbeatRequest(1, 0, 2**62, "inc"),
    HeartbeatRequest(0, 1, 7, "inc", quorum="b1-42"),
    HeartbeatResponse(3),
    HeartbeatResponse(4, "group 1 of quorum b1-42 failed: it started again"),
    ProgressRequest(0, 1, {"step": 3, "loss": 2.5, "whole": 3.0, "codec": "int8", "healing": False,
                           "big": -2**63}),
    RoundRequest(1, 7, "sha256:abc"),
    SummaryRequest(0, {"a": [1, 2.5, None, {"b": "c", "é": ["ü"]}], "ok": True, "n": {"m": {}}, "e": []}),
    BandwidthRequest(0, 1, {1: 1.5e9, 2: 0.0}),
    PlanRequest(0),
    PlanResponse(3, {0: {0: {1: 5.0}, 1: {1: 7.0}}, 1: {0: {0: 2.0}}}),
    PlanResponse(0, {}),
    QuorumRequest(0, 1, "inc", -1, "f0/r12", 2**40, 1024.0, "sha256:aa", 3.5, True, False),
    QuorumResponse("boot:1", 4, 1, "f0/r4", 10, {0: ("h:1",), 2: ("h:3", "h:4")}, {0: 1.0, 2: 0.0},
                   healers=(2,), donor=0, rejected={0: "norm is NaN"}, state_hash="h", evicted="",
                   stop=True),
    QuorumResponse("", -1, 0, "", 0, {}, {}, finished=True),
    CommitRequest(1, 0, "inc", "boot:1", 4, (0, 1), False, "collective aborted"),
    CommitResponse(True, ""),
    StateOffer("boot:1", 0, 0, 2, 1, 4096, DIGEST),
    OfferQuery("boot:1", 2, 1),
    StopRequest("operator asked"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message):
    data = message.encode()
    back = type(message).decode(data)
    assert back == message
    assert type(message).from_pb(type(message).PB.FromString(data)) == message


def test_every_message_type_is_round_tripped():
    assert {type(m) for m in MESSAGES} == {t for pair in RPCS.values() for t in pair}


def test_types_and_nan_survive():
    progress = ProgressRequest.decode(ProgressRequest(0, 0, {"i": 3, "f": 3.0, "loss": math.nan}).encode()).progress
    assert type(progress["i"]) is int and type(progress["f"]) is float and math.isnan(progress["loss"])
    q = QuorumRequest(0, 0, "", 1, "", 0, 0.0, "", math.inf, False, True)
    assert math.isinf(QuorumRequest.decode(q.encode()).delta_norm)
    q = QuorumRequest(0, 0, "", 1, "", 0, 0.0, "", math.nan, False, True)
    assert math.isnan(QuorumRequest.decode(q.encode()).delta_norm)
    order = ["z", "a", "m", "b"]  # objects keep their order (JsonObject is a list, not a map)
    summary = SummaryRequest.decode(SummaryRequest(0, {k: 1 for k in order}).encode()).summary
    assert list(summary) == order


def test_another_client_can_speak_the_protobuf_json_mapping():
    """What grpcurl sends: the proto3 JSON form, NaN included, decodes like our own client's."""
    text = ('{"group": "0", "rank": 1, "progress": {"fields": ['
            '{"key": "loss", "value": {"doubleValue": "NaN"}}, {"key": "step", "value": {"intValue": "7"}}]}}')
    req = ProgressRequest.decode(json_format.Parse(text, pb.ProgressRequest()).SerializeToString())
    assert req.group == 0 and req.rank == 1 and req.progress["step"] == 7 and math.isnan(req.progress["loss"])


@pytest.mark.parametrize("message,pattern", [
    (ProgressRequest(0, 0, {"x": 2**64}), "does not fit in 64 bits"),
    (ProgressRequest(0, 0, {"x": object()}), "cannot encode object"),
    (JoinRequest(True, 0, 1, "h:1"), "group: expected an integer, got bool"),  # type: ignore[arg-type]
    (SummaryRequest(0, {"k": {1.5: "x", None: "y", (1,): "z"}}), "object key \\(1,\\) is not a string"),
])
def test_encode_refuses_what_the_schema_cannot_carry(message: Message, pattern: str):
    with pytest.raises(MessageError, match=pattern):
        message.encode()


# --- INVALID_ARGUMENT through a real server -----------------------------------------------------

@pytest.fixture
def server():
    srv = CoordinatorServer("127.0.0.1", 0, expected_groups=2, join_timeout_s=5.0)
    srv.start()
    yield srv
    srv.stop(grace_s=0.2)


def call(address: str, method: str, payload: bytes, *, credentials: grpc.ChannelCredentials | None = None,
         timeout_s: float = 5.0, metadata=()) -> bytes:
    """One raw unary call, as any gRPC client would make it."""
    channel = (grpc.secure_channel(address, credentials) if credentials is not None
               else grpc.insecure_channel(address))
    with channel:
        return channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=timeout_s, metadata=metadata)


@pytest.mark.parametrize("method", sorted(set(RPCS) - {"Ping"}))
def test_an_empty_request_names_its_missing_fields(server, method):
    with pytest.raises(grpc.RpcError) as info:
        call(server.address, method, b"")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.fullmatch(rf"{method}: {RPCS[method][0].__name__}: missing field\(s\) \w.*", info.value.details())


def wire(message: Message) -> bytes:
    """``message`` on the wire without the sender's own validation (as a foreign client may send)."""
    return message.to_pb().SerializeToString()


@pytest.mark.parametrize("method,payload,pattern", [
    ("Quorum", wire(QuorumRequest(0, 0, "", 1, "", 0, math.nan, "", 0.0, False, True)), "weight: nan is not finite"),
    ("Quorum", wire(QuorumRequest(0, 0, "", 1, "bad tag", 0, 1.0, "", 0.0, False, True)), "tag: .*characters outside"),
    ("Quorum", wire(QuorumRequest(0, 0, "", 1, "", 2**41, 1.0, "", 0.0, False, True)), "numel: .* out of range"),
    ("Commit", wire(CommitRequest(2, 0, "", "q", 0, (0, 1), True)), "group 2 votes on a quorum of groups"),
    ("Commit", wire(CommitRequest(0, 0, "", "q", 0, (0, 0), True)), "groups: repeated group ids"),
    ("OfferState", wire(StateOffer("q", 0, 0, 1, 0, 1, "XYZ")), "digest: .*characters outside"),
    ("ReportBandwidth", wire(BandwidthRequest(0, 0, {1: -5.0})), r"rates\[1\]: expected a finite rate"),
    ("ReportBandwidth", wire(BandwidthRequest(0, 0, {-1: 5.0})), "rates: key '-1' is not a group id"),
    ("ReportProgress", wire(ProgressRequest(0, 0, {"n": [1]})), "progress\\['n'\\]: expected a number"),
    ("ReportSummary", wire(SummaryRequest(5000, {})), "group: 5000 is out of range"),
    ("RequestStop", wire(StopRequest("x" * 600)), "reason: expected a string of at most 512"),
    ("GetPlan", wire(PlanRequest(-3)), "exchange: -3 is out of range"),
    ("Heartbeat", wire(HeartbeatRequest(0, 0, 1)) + b"\xa0\x06\x01", "unknown field.*100"),
    ("Join", pb.JoinRequest(group=0, rank=0, group_size=1, address="h:1", incarnation="a b").SerializeToString(),
     "incarnation: .*characters outside"),
    ("ReportSummary", pb.SummaryRequest(group=0, summary=pb.JsonObject(fields=[
        pb.JsonField(key="a", value=pb.JsonValue(int_value=1)),
        pb.JsonField(key="a", value=pb.JsonValue(int_value=2))])).SerializeToString(), r"summary\['a'\]: repeated key"),
    ("ReportSummary", pb.SummaryRequest(group=0, summary=pb.JsonObject(fields=[
        pb.JsonField(key="a", value=pb.JsonValue())])).SerializeToString(), "a JsonValue with no kind set"),
])
def test_bad_fields_are_invalid_argument_naming_the_field(server, method, payload, pattern):
    with pytest.raises(grpc.RpcError) as info:
        call(server.address, method, payload)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{method}: ") and re.search(pattern, info.value.details())
    assert Ack.decode(call(server.address, "Ping", b"")) == Ack(0)  # still serving, nothing changed
    assert server.snapshot()["groups"] == {} and server.snapshot()["summaries"] == {}


# --- mutual TLS ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[dict[str, TlsConfig], dict[str, TlsConfig]]:
    d = tmp_path_factory.mktemp("pki")
    return write_pki(d / "good", ["coordinator", "worker"]), write_pki(d / "evil", ["mallory"])


@pytest.fixture
def tls_server(pki):
    good, _ = pki
    srv = CoordinatorServer("127.0.0.1", 0, expected_groups=1, token=TOKEN, tls=good["coordinator"],
                            join_timeout_s=5.0)
    srv.start()
    yield srv
    srv.stop(grace_s=0.2)


def test_client_with_the_right_certificate_works(tls_server, pki):
    good, _ = pki
    assert tls_server.tls
    with CoordinatorClient(tls_server.address, token=TOKEN, tls=good["worker"], timeout_s=5.0) as c:
        assert c.tls and c.join(0, 0, 1, "127.0.0.1:20000").groups == [0]
        c.report_progress(0, 0, {"loss": math.nan})
    assert math.isnan(tls_server.snapshot()["progress"][0]["loss"])
    with pytest.raises(CoordinatorError, match="wrong coordinator token") as info:  # TLS is not the token
        CoordinatorClient(tls_server.address, token="guess", tls=good["worker"], timeout_s=5.0)
    assert info.value.code == "UNAUTHENTICATED"


@pytest.mark.parametrize("who", ["wrong CA", "certificate from another CA"])
def test_client_from_another_pki_is_refused(tls_server, pki, who):
    good, evil = pki
    # "wrong CA": trusts another CA (rejects the coordinator); the other one presents a certificate
    # the coordinator's CA did not sign (the coordinator rejects it)
    tls = evil["mallory"] if who == "wrong CA" else TlsConfig(evil["mallory"].cert_file,
                                                             evil["mallory"].key_file, good["worker"].ca_file)
    with pytest.raises(CoordinatorError, match=r"cannot reach coordinator .*\(this side speaks TLS") as info:
        CoordinatorClient(tls_server.address, token=TOKEN, tls=tls, timeout_s=REFUSED_S)
    assert info.value.code in ("DEADLINE_EXCEEDED", "UNAVAILABLE")
    assert tls_server.snapshot()["groups"] == {}


def test_client_without_a_certificate_is_refused(tls_server, pki):
    good, _ = pki
    with open(good["worker"].ca_file, "rb") as f:
        only_ca = grpc.ssl_channel_credentials(root_certificates=f.read())  # checks the server, shows nothing
    with pytest.raises(grpc.RpcError) as info:
        call(tls_server.address, "Ping", b"", credentials=only_ca, timeout_s=REFUSED_S,
             metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_plaintext_client_against_tls_server_fails_clearly(tls_server):
    with pytest.raises(CoordinatorError, match=r"cannot reach coordinator at 127\.0\.0\.1:\d+ within 1s: .*"
                                               r"plain text: if the coordinator serves TLS, give this side") as info:
        CoordinatorClient(tls_server.address, token=TOKEN, timeout_s=REFUSED_S)
    assert info.value.code in ("DEADLINE_EXCEEDED", "UNAVAILABLE")


def test_tls_client_against_plaintext_server_fails_clearly(server, pki):
    good, _ = pki
    with pytest.raises(CoordinatorError, match="(?i)cannot reach coordinator .*handshake.*this side speaks TLS"):
        CoordinatorClient(server.address, tls=good["worker"], timeout_s=REFUSED_S)


def test_unreadable_certificate_is_a_clear_error(tmp_path):
    missing = TlsConfig(str(tmp_path / "c.pem"), str(tmp_path / "c.key"), str(tmp_path / "ca.pem"))
    with pytest.raises(ValueError, match=r"coordinator TLS: cannot read .*c\.pem"):
        CoordinatorServer("127.0.0.1", 0, tls=missing)
    with pytest.raises(ValueError, match=r"coordinator TLS: cannot read .*c\.pem"):
        CoordinatorClient("127.0.0.1:1", tls=missing)


def test_workers_use_the_data_plane_certificates_off_loopback(pki):
    good, _ = pki
    w = good["worker"]
    t = TransportConfig(tls_cert=w.cert_file, tls_key=w.key_file, tls_ca=w.ca_file)
    assert coordinator_tls(t, "coord.example:29400") == TlsConfig(w.cert_file, w.key_file, w.ca_file)
    assert coordinator_tls(t, "[2001:db8::1]:29400") is not None
    assert coordinator_tls(t, "127.0.0.1:29400") is None  # diloco run: its coordinator is on loopback
    assert coordinator_tls(t, "[::1]:29400") is None and coordinator_tls(t, "localhost:1") is None
    assert coordinator_tls(TransportConfig(), "coord.example:29400") is None


# --- exposure: non-loopback needs TLS and a token -----------------------------------------------

def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine's own interfaces that is not loopback (bound, never dialed)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    candidates = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    if not candidates:
        try:
            candidates = [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
        except OSError:
            candidates = []
    return next((a for a in candidates if not ipaddress.ip_address(a).is_loopback), None)


INTERFACE = non_loopback_ipv4()
HOSTS = ["0.0.0.0", "::", pytest.param(INTERFACE, marks=pytest.mark.skipif(
    INTERFACE is None, reason="this machine has no non-loopback IPv4 address"), id="interface")]


@pytest.mark.parametrize("host", HOSTS)
def test_non_loopback_host_needs_tls_and_token(host, pki):
    good, _ = pki
    for token, tls, missing in ((None, None, "without mutual TLS .* and a token"),
                                (TOKEN, None, "without mutual TLS"),
                                (None, good["coordinator"], "without a token")):
        with pytest.raises(ValueError, match=f"refusing to serve the coordinator on non-loopback host "
                                             f"'{re.escape(host)}' {missing}.*--insecure-coordinator"):
            CoordinatorServer(host, 0, token=token, tls=tls)
    if host == "::":  # binding it needs IPv6; the refusals above did not bind
        return
    with CoordinatorServer(host, 0, token=TOKEN, tls=good["coordinator"]) as srv:  # both given: it serves
        assert srv.tls and srv.address.startswith(f"{host}:")
        if host == "0.0.0.0":  # dialed on loopback only
            port = srv.address.rsplit(":", 1)[1]
            with CoordinatorClient(f"127.0.0.1:{port}", token=TOKEN, tls=good["worker"], timeout_s=5.0) as c:
                assert c.plan(0) == (0, {})


def test_loopback_needs_neither():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        CoordinatorServer(host, 0)  # not started: the check is in the constructor


def test_opt_in_serves_without_tls_and_warns(caplog):
    with CoordinatorServer("0.0.0.0", 0, allow_insecure=True) as srv:
        port = int(srv.address.rsplit(":", 1)[1])
        with CoordinatorClient(f"127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.plan(0) == (0, {})
    assert "without TLS and a token (--insecure-coordinator)" in caplog.text


def test_cli_refuses_non_loopback_without_tls_and_token(capsys, monkeypatch):
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    assert cli.main(["coordinator", "--host", "0.0.0.0", "--port", "0", "--groups", "1"]) == 2
    err = capsys.readouterr().err
    assert "diloco coordinator: error: refusing to serve the coordinator on non-loopback host '0.0.0.0'" in err
    assert cli.main(["coordinator", "--host", "127.0.0.1", "--port", "0", "--tls-cert", "x.pem"]) == 2
    assert "--tls-cert, --tls-key and --tls-ca go together" in capsys.readouterr().err


class CoordinatorProcess:
    """``diloco coordinator --host 0.0.0.0 --port 0`` with extra flags; dialed on 127.0.0.1."""

    def __init__(self, *args: str, token: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "DILOCO_TOKEN"}
        if token is not None:
            env["DILOCO_TOKEN"] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco", "coordinator", "--host", "0.0.0.0", "--port", "0", "--groups", "1",
             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self._watchdog = threading.Timer(30.0, self.proc.kill)
        self._watchdog.start()
        self.address = ""

    def wait_listening(self) -> str:
        """Read the first line; returns the address to dial."""
        first = self.proc.stdout.readline()
        found = re.fullmatch(r"diloco coordinator listening on 0\.0\.0\.0:(\d+) for 1 groups\n", first)
        if found is None:
            _, err = self.stop()
            raise AssertionError(f"unexpected first line {first!r}; stderr: {err}")
        self.address = f"127.0.0.1:{found.group(1)}"
        return self.address

    def stop(self) -> tuple[int, str]:
        """SIGTERM, then wait; returns (exit code, the rest of stderr)."""
        self._watchdog.cancel()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=10)
        return self.proc.returncode, err


@pytest.fixture(scope="module")
def cli_coordinators(pki):
    """Two ``diloco coordinator`` processes on 0.0.0.0, started at once: "tls" (mutual TLS and a
    token) and "insecure" (--insecure-coordinator). Both must exit 75 on SIGTERM (the job never finished:
    restart me)."""
    good, _ = pki
    c = good["coordinator"]
    procs = {"tls": CoordinatorProcess("--tls-cert", c.cert_file, "--tls-key", c.key_file, "--tls-ca", c.ca_file,
                                       token=TOKEN),
             "insecure": CoordinatorProcess("--insecure-coordinator")}
    try:
        for p in procs.values():
            p.wait_listening()
        yield procs
    finally:
        results = {name: p.stop() for name, p in procs.items()}
    assert all(code == 75 for code, _ in results.values()), results


def test_cli_serves_mutual_tls_with_a_token(cli_coordinators, pki):
    good, _ = pki
    address = cli_coordinators["tls"].address
    with CoordinatorClient(address, token=TOKEN, tls=good["worker"], timeout_s=5.0) as client:
        assert client.plan(0) == (0, {})
    with pytest.raises(CoordinatorError, match="plain text"):
        CoordinatorClient(address, token=TOKEN, timeout_s=REFUSED_S)
    with pytest.raises(CoordinatorError, match="missing authorization"):
        CoordinatorClient(address, tls=good["worker"], timeout_s=5.0)


def test_cli_opt_in_flag_serves_plain_text_and_says_so(cli_coordinators):
    coord = cli_coordinators["insecure"]
    with CoordinatorClient(coord.address, timeout_s=5.0) as client:
        assert client.plan(0) == (0, {})
    warning = coord.proc.stderr.readline()  # logged when it started serving
    assert "without TLS and a token (--insecure-coordinator)" in warning
