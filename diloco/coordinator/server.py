"""The coordinator's gRPC service: the unary calls of ``coordinator.proto``, protobuf on the wire.

It holds membership, liveness, progress, round hashes and summaries (see ``state.py``); it never
touches tensors. Requests are decoded and validated here (``messages.py``), so a malformed one is
answered with INVALID_ARGUMENT naming the field, never reaches the state and never stops serving.

Security, as on the data plane: with ``tls`` the service speaks mutual TLS (clients must show a
certificate signed by the CA; the same PEM files as ``transport.TlsConfig``), and with ``token``
every call must carry ``authorization: Bearer <credential>``: the job token, or a group's
credential derived from it (``credentials.py``), which may act only for its own group. On a
non-loopback host TLS and a token are required, and the server refuses to start without them
unless ``allow_insecure=True`` (``diloco coordinator --insecure-coordinator``) accepts that anyone
who reaches it can take a group's place.

Availability (``limits.py``): blocking calls (Join, Quorum, Commit, WaitOffer) and quick calls are
capped per caller (its group, or the job token) and overall before a request byte is read, a
request must arrive within ``request_timeout_s``, and the thread pool has room beyond the caps, so
floods and slow clients get RESOURCE_EXHAUSTED or are cut off while ``Ping`` and the other
callers' calls are still answered at once.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import TYPE_CHECKING, Any, Callable, Iterator

import grpc

from transport.addresses import is_loopback

from . import credentials
from .credentials import ADMIN_ONLY, GROUP_FIELDS, GROUP_HEADER, Caller
from .errors import HALTED_TRAILER, CoordinatorError
from .exposure import PemFiles, check_exposure, read_tls
from .limits import (BLOCKING, DEFAULT_MAX_QUICK_CALLS, DEFAULT_MAX_QUICK_PER_CALLER, DEFAULT_REQUEST_TIMEOUT_S,
                     QUEUED_CALLS, SPARE_THREADS, CallLimits, Deadlines)
from .messages import (RPCS, SERVICE, Ack, HeartbeatResponse, JoinRequest, JoinResponse, Message, MessageError,
                       PlanResponse, StopRequest, MAX_SUMMARY_BYTES)
from .quorum import QuorumError
from .state import CoordinatorState

if TYPE_CHECKING:  # the coordinator never imports the transport package (it imports torch)
    from transport.tls import TlsConfig

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 4 * MAX_SUMMARY_BYTES  # above our own limits, so those answer first
DEADLINE_MARGIN_S = 1.0  # a join answers this much before the caller's deadline (at most 10 %)
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    # let clients keep long joins alive with pings (see client.CHANNEL_OPTIONS)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class CoordinatorServer:
    """Coordinator for ``expected_groups`` groups (ids 0..expected_groups-1).

    ``token``: if set, every call must carry ``authorization: Bearer <token>`` metadata.
    ``tls``: serve mutual TLS with these PEM files (a ``transport.TlsConfig``): this server's
    certificate and key, and the CA whose signature admits a client. Clients check that the
    certificate names the host they dial (gRPC always does). ``allow_insecure``: serve on a
    non-loopback ``host`` without TLS or without a token (refused otherwise: ValueError).
    ``join_timeout_s``: longest a join waits for the quorum (seconds).
    ``heartbeat_timeout_s``: silence of any rank after which its group is declared failed and
    left out of every later quorum (seconds). ``min_groups``: fewest groups a quorum may have;
    below it the survivors wait. ``outlier_factor``: a contribution whose norm exceeds this
    multiple of its group's recent median is rejected (0: only NaN/Inf are).
    ``max_group_size``: largest group accepted. ``quorum_grace_s``: once the first group asked for
    an exchange, its quorum forms after this many seconds with the groups that asked by then
    (0: wait for every live group; see ``rounds.decide``). ``checkpoint_hint``: the newest
    checkpoint to name when every group is lost (``job_lost``).

    Limits (see ``limits.py``; over a cap a call is answered RESOURCE_EXHAUSTED at once):
    ``max_blocking_per_caller`` (default 4 x max_group_size: each member of a group may block in
    four calls at once) and ``max_blocking_calls`` (default (expected_groups + 1) x that) bound
    concurrent Join/Quorum/Commit/WaitOffer calls per caller and overall; ``max_quick_per_caller``
    (16) and ``max_quick_calls`` (64) bound the other calls but Ping; ``request_timeout_s`` (5 s)
    is how long a call may take to send its request. A caller is the group whose credential it
    shows (without a token: the group it names, unverified), or the job token. The thread pool
    holds every capped call plus spare threads (started on demand), so Ping never waits for one.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, expected_groups: int = 2, *,
                 token: str | None = None, tls: PemFiles | TlsConfig | None = None,
                 allow_insecure: bool = False, join_timeout_s: float = 120.0,
                 heartbeat_timeout_s: float = 15.0, max_group_size: int = 64, min_groups: int = 1,
                 outlier_factor: float = 10.0, max_blocking_calls: int | None = None,
                 max_blocking_per_caller: int | None = None, max_quick_calls: int = DEFAULT_MAX_QUICK_CALLS,
                 max_quick_per_caller: int = DEFAULT_MAX_QUICK_PER_CALLER,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, restart_when_state_lost: bool = False,
                 quorum_grace_s: float = 0.0, checkpoint_hint: str = "") -> None:
        if token is not None and (not token or not token.isascii() or not token.isprintable()):
            raise ValueError("token must be a non-empty printable ASCII string")
        check_exposure(host, token=token, tls=tls, allow_insecure=allow_insecure)
        self.host = host
        self.port = port
        self._token = token
        self._tls_pem = read_tls(tls) if tls is not None else None
        self._insecure_exposed = not is_loopback(host) and (tls is None or token is None)
        self._unauthenticated = 0  # calls refused for a missing or wrong credential
        self._denied = 0  # calls refused for acting for another group (or admin calls of a group)
        self._state = CoordinatorState(expected_groups, join_timeout_s=join_timeout_s,
                                       heartbeat_timeout_s=heartbeat_timeout_s,
                                       max_group_size=max_group_size, min_groups=min_groups,
                                       outlier_factor=outlier_factor, quorum_grace_s=quorum_grace_s)
        self._state.restart_when_state_lost = restart_when_state_lost
        self._state.checkpoint_hint = checkpoint_hint
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        per_caller = max_blocking_per_caller if max_blocking_per_caller is not None else 4 * max_group_size
        total = max_blocking_calls if max_blocking_calls is not None else (expected_groups + 1) * per_caller
        if per_caller < max_group_size or total < per_caller:
            raise ValueError(f"need max_group_size ({max_group_size}) <= max_blocking_per_caller ({per_caller}) <= "
                             f"max_blocking_calls ({total}): every rank of a group must be able to wait in its join")
        self._limits = CallLimits(total, per_caller, max_quick_calls, max_quick_per_caller)
        self._request_timeout_s = float(request_timeout_s)
        self._deadlines: Deadlines | None = None
        self._workers = total + max_quick_calls + SPARE_THREADS
        self._server: grpc.Server | None = None
        self._address: str | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> str:
        """Bind and start serving on background threads; returns the bound ``host:port``."""
        if self._server is not None:
            raise CoordinatorError("coordinator already started")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._workers,
                                                        thread_name_prefix="coordinator"),
                             options=SERVER_OPTIONS, maximum_concurrent_rpcs=self._workers + QUEUED_CALLS)
        server.add_generic_rpc_handlers((self._handlers(),))
        target = f"{_bracket(self.host)}:{self.port}"
        try:
            if self._tls_pem is not None:
                cert, key, ca = self._tls_pem
                creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                    require_client_auth=True)
                port = server.add_secure_port(target, creds)
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as exc:
            raise CoordinatorError(f"cannot bind coordinator to {target}: {exc}") from None
        if port == 0:
            raise CoordinatorError(f"cannot bind coordinator to {target}")
        self._deadlines = Deadlines()
        server.start()
        self._server = server
        self._address = f"{_bracket(self.host)}:{port}"
        if self._insecure_exposed:
            log.warning("coordinator on %s without %s (--insecure-coordinator): anyone who reaches "
                        "it can take a group's place", self._address,
                        " and ".join(w for w, missing in (("TLS", self._tls_pem is None),
                                                          ("a token", self._token is None)) if missing))
        return self._address

    @property
    def tls(self) -> bool:
        """True if the service speaks mutual TLS."""
        return self._tls_pem is not None

    @property
    def address(self) -> str:
        """The bound ``host:port`` (after start)."""
        if self._address is None:
            raise CoordinatorError("coordinator not started")
        return self._address

    def stop(self, grace_s: float = 1.0) -> None:
        """Release waiting joins, then stop serving within ``grace_s`` seconds. Idempotent."""
        self._state.close()
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        if self._deadlines is not None:
            self._deadlines.close()  # kept: a call still finishing may arm one (it never fires)

    @property
    def call_stats(self) -> dict[str, int]:
        """Counters of the call limits: ``rejected`` (over a cap), ``request_timeouts`` (requests
        that did not arrive in time), ``unauthenticated``, ``denied`` (a call for another group),
        ``blocking_now``, ``blocking_peak``, ``quick_peak``, and the caps."""
        lim = self._limits
        return {"rejected": lim.rejected, "request_timeouts": self._deadlines.fired if self._deadlines else 0,
                "unauthenticated": self._unauthenticated, "denied": self._denied,
                "blocking_now": lim.in_progress(True), "blocking_peak": lim.peak[True], "quick_peak": lim.peak[False],
                "max_blocking_calls": lim.caps[True][0], "max_blocking_per_caller": lim.caps[True][1],
                "max_quick_calls": lim.caps[False][0], "max_quick_per_caller": lim.caps[False][1],
                "threads": self._workers}

    @property
    def stopped(self) -> bool:
        """True once stop() was called (calls are then refused)."""
        return self._state.closed

    @property
    def state_lost(self) -> str | None:
        """Why no group holds the job's state any more (every group was lost; see
        ``restart_when_state_lost``): the coordinator should restart; None while the job is whole."""
        return self._state.state_lost

    @property
    def joined_late(self) -> list[int]:
        """Groups this coordinator told that the job had finished before they could heal: their
        summaries hold no model (``report_job`` leaves them out of the job's figures)."""
        return self.snapshot()["rounds_state"]["joined_late"]

    @property
    def halted(self) -> str | None:
        """Why the job halted (its members differed with no majority, again: no restart mends it);
        None while it runs."""
        return self._state.halted

    @property
    def job_lost(self) -> str | None:
        """"job lost: every group failed; resume from checkpoint (...)" once no group holds the
        job's state (set at once, from heartbeats and restarts); None while one does."""
        return self._state.job_lost

    def set_checkpoint_hint(self, hint: str) -> None:
        """The newest checkpoint to name should every group be lost ("" = none known)."""
        with self._state._cond:
            self._state.checkpoint_hint = hint

    @property
    def tls_certificates(self) -> dict[str, bytes]:
        """The certificate files it serves TLS with (``cert``, ``ca``: PEM), for their expiry metric;
        empty without TLS."""
        if self._tls_pem is None:
            return {}
        cert, _, ca = self._tls_pem
        return {"cert": cert, "ca": ca}

    def __enter__(self) -> CoordinatorServer:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- observers ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Thread-safe deep copy of the state (group and rank ids are ints)::

            expected_groups, epoch (0 before the quorum), complete (bool), ring_order,
            groups: {gid: {"ranks": {rank: address}, "group_size": R}},
            steps: {gid: {rank: last heartbeat step}},
            progress: {gid: latest progress dict of any rank}, progress_by_rank: {gid: {rank: {...}}},
            summaries: {gid: summary}, rounds: {gid: last round reported},
            failed: [{"group", "rank", "silent_s"}], divergence: [{"round", "hashes": {gid: hash}}]
        """
        return self._state.snapshot()

    def wait_for_summaries(self, n: int, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Block until ``n`` groups reported a summary; returns ``{group: summary}``.
        Raises CoordinatorError after ``timeout_s`` seconds, naming the silent groups."""
        try:
            return self._state.wait_for_summaries(n, timeout_s)
        except TimeoutError as exc:
            raise CoordinatorError(str(exc), "DEADLINE_EXCEEDED") from None

    def wait_finished(self, timeout_s: float | None = None) -> dict[int, dict[str, Any]] | None:
        """Block until every expected group reported its summary; returns ``{group: summary}``,
        or None if ``timeout_s`` seconds passed first (None: no limit) or the server stopped."""
        return self._state.wait_finished(timeout_s)

    # --- gRPC plumbing ------------------------------------------------------------------------

    def group_exited(self, group: int, reason: str) -> bool:
        """The launcher saw ``group``'s process tree end: fail it at once (``Liveness.group_exited``).
        In process only: no RPC carries this, so no member can declare another one dead."""
        return self._state.group_exited(group, reason)

    def request_stop(self, reason: str = "") -> None:
        """Ask every group to checkpoint and stop after its next exchange (also an RPC)."""
        self._state.request_stop(reason)

    def _handlers(self) -> grpc.GenericRpcHandler:
        state = self._state

        def deadline(context: grpc.ServicerContext, limit_s: float) -> float:
            """A blocking call's deadline: ``limit_s``, or earlier so that we answer with our
            own message before the caller's deadline."""
            remaining = context.time_remaining()
            if remaining is not None:
                limit_s = min(limit_s, remaining - min(DEADLINE_MARGIN_S, 0.1 * remaining))
            return time.monotonic() + limit_s

        def join(req: JoinRequest, context: grpc.ServicerContext) -> Message:
            m = state.join(req, deadline=deadline(context, state.join_timeout_s), active=context.is_active)
            return JoinResponse(epoch=m.epoch, members=dict(m.members), ring_order=m.ring, heal=m.heal,
                                setting=m.setting, resume_step=m.resume_step)

        def stop(req: StopRequest, context: grpc.ServicerContext) -> Message:
            state.request_stop(req.reason)
            return Ack(state.epoch)

        methods: dict[str, Callable[[Any, grpc.ServicerContext], Message]] = {
            "Ping": lambda r, c: Ack(state.epoch),
            "Join": join,
            "Heartbeat": lambda r, c: HeartbeatResponse(state.heartbeat(r), state.quorum_lost(r.quorum, r.group)),
            "ReportProgress": lambda r, c: Ack(state.progress(r)),
            "ReportRound": lambda r, c: Ack(state.round(r)),
            "ReportSummary": lambda r, c: Ack(state.summary(r)),
            "ReportBandwidth": lambda r, c: Ack(state.bandwidth(r)),
            "GetPlan": lambda r, c: PlanResponse(*state.plan(r.exchange)),
            "Quorum": lambda r, c: state.quorum(
                r, deadline=deadline(c, state.join_timeout_s), active=c.is_active),
            "Commit": lambda r, c: state.commit(
                r, deadline=deadline(c, state.join_timeout_s), active=c.is_active),
            "OfferState": lambda r, c: Ack(state.offer(r)),
            "WaitOffer": lambda r, c: state.wait_offer(
                r, deadline=deadline(c, state.join_timeout_s), active=c.is_active),
            "RequestStop": stop,
        }
        if set(methods) != set(RPCS):  # the .proto's service is the contract
            raise CoordinatorError(f"handlers {sorted(methods)} do not match the service {sorted(RPCS)}")
        # Registered as stream-unary (the wire is the same as unary): gRPC then starts our code as
        # soon as a call arrives, before its request, so the caps and the request deadline apply
        # to callers that send their request slowly or never.
        return grpc.method_handlers_generic_handler(SERVICE, {
            name: grpc.stream_unary_rpc_method_handler(self._wrap(name, *RPCS[name], fn))
            for name, fn in methods.items()})

    def _wrap(self, name: str, request_type: type[Message], reply_type: type[Message],
              fn: Callable[[Any, grpc.ServicerContext], Message]
              ) -> Callable[[Iterator[bytes], grpc.ServicerContext], bytes]:
        """Authenticate, take a call slot, read, decode and validate the raw request, check that
        the caller may act for the request's group, run ``fn``, encode the reply.

        Decoding happens here rather than in a request_deserializer because gRPC answers a
        failing deserializer with INTERNAL, not INVALID_ARGUMENT.
        """
        blocking = name in BLOCKING

        def behavior(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            caller = self._authorize(context)
            if name in ADMIN_ONLY and not caller.admin:
                self._denied += 1
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"{name}: only the job token may call it, not {caller.key}'s credential")
            if name == "Ping":  # no slot and no request to wait for: always answered at once
                return Ack(self._state.epoch).encode()
            why = self._limits.enter(blocking, caller.key)
            if why is not None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{name}: coordinator busy: {why}")
            try:
                raw = self._read_request(name, requests, context)
                try:
                    req = request_type.decode(raw)
                except MessageError as exc:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {exc}")
                self._check_group(name, req, caller, context)
                try:
                    reply = fn(req, context)
                except QuorumError as exc:
                    if exc.halted:  # no restart mends it: the caller stops (exit 2), not restarts (75)
                        context.set_trailing_metadata(((HALTED_TRAILER, "1"),))
                    context.abort(grpc.StatusCode[exc.code], f"{name}: {exc}")
                if not isinstance(reply, reply_type):
                    raise TypeError(f"{name} answered {type(reply).__name__}, not {reply_type.__name__}")
                return reply.encode()
            finally:
                self._limits.leave(blocking, caller.key)

        return behavior

    def _read_request(self, name: str, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """The call's one request message; the call is cancelled if it has not arrived within
        request_timeout_s."""
        deadlines = self._deadlines
        assert deadlines is not None  # set by start(), before any call can come
        peer = context.peer()
        token = deadlines.arm(time.monotonic() + self._request_timeout_s, context.cancel)
        try:
            raw = next(requests, None)
        except grpc.RpcError:
            raw = None
        finally:
            late = not deadlines.disarm(token)
        if late:
            log.warning("%s from %s: the request did not arrive within %g s; call cancelled", name, peer,
                        self._request_timeout_s)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"{name}: the request did not arrive within {self._request_timeout_s:g} s")
        if raw is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: the call carried no request message")
        return raw

    def _check_group(self, name: str, req: Message, caller: Caller, context: grpc.ServicerContext) -> None:
        """Refuse a group-scoped call for another group than the caller's (PERMISSION_DENIED)."""
        field = GROUP_FIELDS.get(name)
        if field is None or caller.group is None:
            return  # not group-scoped, or the job token (or no token and no group named)
        group = getattr(req, field)
        if group != caller.group:
            self._denied += 1
            who = f"{caller.key}'s credential" if caller.verified else f"a caller naming {caller.key}"
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{name} for group {group} from {who}: a group "
                          "acts only for itself")

    def _authorize(self, context: grpc.ServicerContext) -> Caller:
        """Who the caller is; aborts UNAUTHENTICATED without a valid credential (when a token is set)."""
        metadata = context.invocation_metadata() or ()
        if self._token is None:
            named = next((v for k, v in metadata if k == GROUP_HEADER), None)
            group = int(named) if isinstance(named, str) and named.isdigit() and len(named) <= 9 else None
            return Caller(admin=True, group=group, verified=False)
        given = next((v for k, v in metadata if k == "authorization"), None)
        if given is None:
            self._unauthenticated += 1
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing authorization metadata")
        text = given if isinstance(given, str) else bytes(given).decode("ascii", "replace")
        scheme, _, bearer = text.partition(" ")
        caller = credentials.check(self._token, bearer) if scheme == "Bearer" else None
        if caller is None:
            self._unauthenticated += 1
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong coordinator token (or group credential)")
        return caller
