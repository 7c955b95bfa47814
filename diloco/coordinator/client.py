"""Client of the coordinator, used by every rank of every group. Every call has a deadline."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc

from .credentials import GROUP_FIELDS, GROUP_HEADER, group_token, parse_group_token
from .errors import HALTED_TRAILER, CoordinatorError
from .membership import Membership
from .messages import (
    RPCS,
    SERVICE,
    Ack,
    BandwidthRequest,
    CommitRequest,
    CommitResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinRequest,
    JoinResponse,
    Message,
    MessageError,
    OfferQuery,
    Ping,
    PlanRequest,
    PlanResponse,
    ProgressRequest,
    QuorumRequest,
    QuorumResponse,
    RoundRequest,
    StateOffer,
    StopRequest,
    SummaryRequest,
)
from .exposure import PemFiles, read_tls
from .server import GRPC_MAX_MESSAGE_BYTES
from .waiting import waiting

if TYPE_CHECKING:
    from transport.tls import TlsConfig

log = logging.getLogger(__name__)

JOIN_DEADLINE_S = 3600.0  # default client-side bound on a join; the server's join_timeout_s is
                          # normally the tighter one and answers with the missing members
#: longest wait between a channel's attempts to reach a coordinator that went away (gRPC's default
#: grows to 120 s): a restarted coordinator is found within a second by every rank, and the ranks
#: rejoin it together (joins.MIN_REJOIN_GRACE_S), not seconds apart by the luck of their backoff.
#: (Not grpc.min_reconnect_backoff_ms: gRPC takes it as the time one attempt may last, 20 s by
#: default, which a TLS handshake across datacenters may need more than a second of.)
MAX_RECONNECT_BACKOFF_MS = 1000
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    # detect a coordinator that vanished without closing the connection during a long join
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class CoordinatorClient:
    """Connects to the coordinator at ``address`` (``host:port``).

    Pings the coordinator, waiting up to ``timeout_s`` seconds for it to be reachable, and raises
    CoordinatorError if it is not or if it refuses ``token``. Afterwards every call waits for a
    connection up to the same deadline, and a call the coordinator is too busy for
    (RESOURCE_EXHAUSTED) is retried with backoff within the call's own deadline.

    ``token``: the job token, or one group's credential (``credentials.group_token``). Calls for
    a group carry that group's credential (derived here from the job token, so the job token
    itself travels only with Ping, GetPlan and RequestStop); with a group's credential the client
    can act only for that group. Sent as ``authorization: Bearer <credential>`` metadata; without
    a token, calls for a group name it in ``diloco-group`` metadata (the coordinator's fair share).

    ``tls``: speak mutual TLS with these PEM files (a ``transport.TlsConfig``): this client's
    certificate and key, and the CA that must have signed the coordinator's certificate, which
    must also name the host of ``address`` (gRPC checks it). Without it the channel is plain text:
    a coordinator that serves TLS is then unreachable, and the error says so.
    """

    def __init__(self, address: str, *, token: str | None = None, tls: PemFiles | TlsConfig | None = None,
                 timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.tls = tls is not None
        self._token = token
        self._group_tokens: dict[int, tuple[tuple[str, str], ...]] = {}
        self._own_group = parse_group_token(token) if token is not None else None
        if tls is not None:
            cert, key, ca = read_tls(tls)
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            self._channel = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._calls = {name: self._channel.unary_unary(f"/{SERVICE}/{name}") for name in RPCS}
        # A real call rather than channel_ready_future: subscribing to connectivity starts a
        # polling thread in grpcio that can raise "Channel closed!" when the channel closes.
        try:
            self._call("Ping", Ping(), Ack,
                       waits_for=lambda: f"the coordinator at {address} to answer ({self._connect_error()})")
        except CoordinatorError as exc:
            try:
                if exc.code in ("DEADLINE_EXCEEDED", "UNAVAILABLE"):
                    raise CoordinatorError(f"cannot reach coordinator at {address} within {timeout_s:g}s: "
                                           f"{self._last_error(exc)}", exc.code) from None
                raise
            finally:
                self._channel.close()

    def _probe(self) -> str | None:
        """The channel's last connection error (a TLS handshake that failed, say), or None when it
        answers now: a call without wait_for_ready fails at once with that error."""
        try:
            self._calls["Ping"](Ping().encode(), timeout=1.0, metadata=self._metadata("Ping", Ping()))
        except grpc.RpcError as probe:
            details = probe.details() if hasattr(probe, "details") else ""
            return details or str(probe)
        except ValueError as e:  # a closed channel
            return str(e)
        return None

    def _connect_error(self) -> str:
        why = self._probe()
        return "it answers now" if why is None else f"last error: {why}"

    def _last_error(self, exc: CoordinatorError) -> str:
        """Why the channel cannot connect (a TLS handshake that failed, say), with a hint."""
        why = str(exc).split(" failed: ", 1)[-1]
        details = self._probe()
        if details is None:
            return why  # reachable now: the coordinator was slow to start
        if "last error" in details:
            why = details
        if "Connection refused" in why:  # nothing listens there: TLS is not the question
            return why
        if self.tls:
            return (f"{why} (this side speaks TLS: the coordinator must serve TLS with a certificate signed "
                    "by our CA that names the host we dial, and accept ours)")
        return (f"{why} (plain text: if the coordinator serves TLS, give this side its TLS files: "
                "--tls-cert/--tls-key/--tls-ca, or tls=)")

    # --- calls --------------------------------------------------------------------------------

    def join(self, group: int, rank: int, group_size: int, address: str, *, incarnation: str = "",
             exchange: int = -1, resume_step: int = -1, resume_exact: bool = False,
             timeout_s: float | None = None) -> Membership:
        """Register this rank's data-plane ``address`` (``host:port``) and block until every
        expected group has all its ranks (once the job runs: until this group's ranks have, and
        the membership says ``heal``); returns the membership. ``incarnation``: the same for every
        rank of this start of the group. ``exchange``: >= 0 to rejoin a restarted coordinator as
        a member at that exchange. ``resume_step``: the newest job checkpoint step this group may
        resume from if the job starts now (-1: none; the coordinator makes a group behind the
        newest a healer); ``resume_exact``: that step was named, and every group must name it.
        ``timeout_s`` bounds the wait on this side (default
        JOIN_DEADLINE_S); the server's join_timeout_s usually ends it first with an error naming
        the missing groups and ranks."""
        reply = self._call("Join", JoinRequest(group, rank, group_size, address, incarnation, exchange, resume_step,
                                               resume_exact),
                           JoinResponse, JOIN_DEADLINE_S if timeout_s is None else timeout_s,
                           waits_for=f"every group to join at the coordinator {self.address} (group {group} rank {rank})")
        assert isinstance(reply, JoinResponse)
        return Membership(epoch=reply.epoch, members=reply.members, ring=reply.ring_order, heal=reply.heal,
                          setting=reply.setting, resume_step=reply.resume_step)

    def heartbeat(self, group: int, rank: int, step: int, incarnation: str = "", quorum: str = "") -> str:
        """Tell the coordinator this rank is alive at inner ``step`` (running the rings of
        ``quorum``, if not ""). Returns why that quorum can no longer commit ("" if it can: see
        ``HeartbeatResponse``). Raises CoordinatorError (code FAILED_PRECONDITION or NOT_FOUND)
        if it declared this group failed or never saw it."""
        reply = self._call("Heartbeat", HeartbeatRequest(group, rank, step, incarnation, quorum), HeartbeatResponse)
        assert isinstance(reply, HeartbeatResponse)
        return reply.quorum_lost

    def quorum(self, request: QuorumRequest, *, timeout_s: float | None = None) -> QuorumResponse:
        """Block until the quorum of this rank's exchange is decided (``diloco.coordinator.rounds``)."""
        what = ("a quorum to heal into" if request.exchange < 0 else
                f"the other groups to reach exchange {request.exchange} ({request.tag}), for its quorum")
        reply = self._call("Quorum", request, QuorumResponse, JOIN_DEADLINE_S if timeout_s is None else timeout_s,
                           waits_for=what)
        assert isinstance(reply, QuorumResponse)
        return reply

    def commit(self, request: CommitRequest, *, timeout_s: float | None = None) -> CommitResponse:
        """Vote on a quorum; block until it is decided (committed or rolled back)."""
        reply = self._call("Commit", request, CommitResponse, JOIN_DEADLINE_S if timeout_s is None else timeout_s,
                           waits_for=f"every member's vote on {request.quorum_id}")
        assert isinstance(reply, CommitResponse)
        return reply

    def offer_state(self, offer: StateOffer) -> None:
        """As a donor rank: announce the state served to one healer rank."""
        self._call("OfferState", offer, Ack)

    def wait_offer(self, query: OfferQuery, *, timeout_s: float | None = None) -> StateOffer:
        """As a healer rank: wait for the donor's offer."""
        reply = self._call("WaitOffer", query, StateOffer, timeout_s, waits_for="the donor group's state offer")
        assert isinstance(reply, StateOffer)
        return reply

    def request_stop(self, reason: str = "") -> None:
        """Ask every group to checkpoint and stop after its next exchange."""
        self._call("RequestStop", StopRequest(reason), Ack)

    def report_progress(self, group: int, rank: int, progress: dict[str, Any]) -> None:
        """Send this rank's latest progress: a flat dict of short keys to int, float, bool or
        short str (step, loss, tokens_per_s, bytes_sent, round, H ...)."""
        self._call("ReportProgress", ProgressRequest(group, rank, dict(progress)), Ack)

    def report_round(self, group: int, round: int, param_hash: str) -> None:
        """Record that ``group`` committed outer ``round`` with global parameters hashing to
        ``param_hash``; differing hashes across groups show up as a divergence."""
        self._call("ReportRound", RoundRequest(group, round, param_hash), Ack)

    def report_summary(self, group: int, summary: dict[str, Any]) -> None:
        """Send ``group``'s final summary: a JSON-able dict (at most 1 MiB, nesting 8)."""
        self._call("ReportSummary", SummaryRequest(group, summary), Ack)

    def report_bandwidth(self, group: int, rank: int, rates: dict[int, float]) -> None:
        """Send what this rank measured towards each other group, in bytes/s by group id."""
        self._call("ReportBandwidth", BandwidthRequest(group, rank, dict(rates)), Ack)

    def plan(self, exchange: int) -> tuple[int, dict[int, dict[int, dict[int, float]]]]:
        """(version, bandwidth table) that governs ``exchange``; the same answer for every rank."""
        reply = self._call("GetPlan", PlanRequest(exchange), PlanResponse)
        assert isinstance(reply, PlanResponse)
        return reply.version, reply.table

    def close(self) -> None:
        """Close the channel. Idempotent."""
        self._channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing -----------------------------------------------------------------------------

    def _metadata(self, name: str, request: Message) -> tuple[tuple[str, str], ...]:
        """The credential a call carries: its group's for a group's call, else the token as given."""
        field = GROUP_FIELDS.get(name)
        group = getattr(request, field) if field is not None else None
        if self._token is None:
            return ((GROUP_HEADER, str(group)),) if group is not None else ()
        if group is None or self._own_group is not None:  # not a group's call, or we are one group
            return (("authorization", f"Bearer {self._token}"),)
        if group not in self._group_tokens:
            self._group_tokens[group] = (("authorization", f"Bearer {group_token(self._token, group)}"),)
        return self._group_tokens[group]

    def _call(self, name: str, request: Message, reply_type: type[Message],
              timeout_s: float | None = None, waits_for: Any = None) -> Message:
        """One call, retried while the coordinator is busy; ``waits_for`` (a text, or a function
        giving one) is logged every few seconds while the answer is awaited."""
        with waiting(log, waits_for) if waits_for is not None else contextlib.nullcontext():
            return self._call_now(name, request, reply_type, timeout_s)

    def _call_now(self, name: str, request: Message, reply_type: type[Message],
                  timeout_s: float | None = None) -> Message:
        assert (type(request), reply_type) == RPCS[name], name
        try:
            data = request.encode()
        except MessageError as exc:
            raise CoordinatorError(f"invalid {name} request: {exc}") from None
        metadata = self._metadata(name, request)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        delay = 0.05
        while True:
            try:
                raw = self._calls[name](data, timeout=max(deadline - time.monotonic(), 0.001), metadata=metadata,
                                        wait_for_ready=True)
                break
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else str(exc)
                code_name = code.name if code is not None else None
                if code_name == "RESOURCE_EXHAUSTED" and deadline - time.monotonic() > delay:
                    time.sleep(delay)  # the coordinator is busy (its call caps): back off and retry
                    delay = min(2 * delay, 1.0)
                    continue
                trailer = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
                halted = any(key == HALTED_TRAILER for key, _ in trailer or ())
                raise CoordinatorError(f"coordinator {self.address}: {name} failed: "
                                       f"{code_name}: {details}", code_name, halted=halted) from None
            except ValueError as exc:  # grpc raises ValueError on a closed channel
                raise CoordinatorError(f"coordinator {self.address}: {name}: {exc}") from None
        try:
            return reply_type.decode(raw)
        except MessageError as exc:
            raise CoordinatorError(f"coordinator {self.address}: bad {name} reply: {exc}") from None
