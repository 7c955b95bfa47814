"""The coordinator's HTTP side: Prometheus ``/metrics``, a JSON ``/status`` document, ``/healthz``.

    diloco coordinator --metrics-port 9400      # http://HOST:9400/metrics, /status, /healthz

Everything here is read from ``CoordinatorServer.snapshot()`` at request time (a custom collector),
so it needs no hook inside the gRPC service and follows whatever the service knows. ``/status`` is
what ``diloco status`` reads: it is plain JSON over HTTP rather than a gRPC call so that it does not
depend on the coordinator's RPC protocol, and any tool (curl, a browser) can read it. When the
coordinator has a token, ``/status`` (which names member addresses) needs
``Authorization: Bearer <token>``; ``/metrics`` and ``/healthz`` carry no addresses and are open.
Torch-free, like the rest of the coordinator.
"""

from __future__ import annotations

import hmac
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from . import rounds

STATUS_VERSION = 1
Snapshot = Callable[[], dict[str, Any]]

# name as exposed -> type; the single list the docs, dashboard and rules are checked against
COORDINATOR_SERIES: dict[str, str] = {
    "diloco_coordinator_expected_groups": "gauge",
    "diloco_coordinator_epoch": "gauge",
    "diloco_coordinator_quorum_complete": "gauge",
    "diloco_coordinator_quorum_groups": "gauge",
    "diloco_coordinator_finished_groups": "gauge",
    "diloco_coordinator_diverged_rounds": "gauge",
    "diloco_coordinator_plan_version": "gauge",
    "diloco_coordinator_group_size": "gauge",
    "diloco_coordinator_group_joined_ranks": "gauge",
    "diloco_coordinator_group_failed_ranks": "gauge",
    "diloco_coordinator_group_ring_position": "gauge",
    "diloco_coordinator_group_round": "gauge",
    "diloco_coordinator_group_step": "gauge",
    "diloco_coordinator_group_target_steps": "gauge",
    "diloco_coordinator_group_tokens_per_second": "gauge",
    "diloco_coordinator_group_utilization_ratio": "gauge",
    "diloco_coordinator_group_train_loss": "gauge",
    "diloco_coordinator_group_sync_period_steps": "gauge",
    "diloco_coordinator_group_sent_bytes_total": "counter",
    "diloco_coordinator_group_finished": "gauge",
    "diloco_coordinator_link_bandwidth_bytes_per_second": "gauge",
    # from the rounds state of a fault-tolerant coordinator, when its snapshot has one
    "diloco_coordinator_live_groups": "gauge",
    "diloco_coordinator_healing_groups": "gauge",
    "diloco_coordinator_joined_late_groups": "gauge",
    "diloco_coordinator_stopped_groups": "gauge",
    "diloco_coordinator_job_lost": "gauge",
    "diloco_coordinator_job_halted": "gauge",
    "diloco_coordinator_rounds_committed_total": "counter",
    "diloco_coordinator_rounds_rolled_back_total": "counter",
    "diloco_coordinator_heals_total": "counter",
    "diloco_coordinator_group_failures_total": "counter",
    "diloco_coordinator_rejected_contributions_total": "counter",
    "diloco_coordinator_evictions_total": "counter",
    "diloco_coordinator_catch_ups_total": "counter",
    # the coordinator's own TLS files: when each certificate stops being valid
    "diloco_coordinator_tls_certificate_expiry_timestamp_seconds": "gauge",
}

# rounds-state count -> (counter name without _total, help)
_ROUND_COUNTS = (
    ("committed", "rounds_committed", "Outer rounds the quorum committed"),
    ("rolled_back", "rounds_rolled_back", "Outer rounds the quorum abandoned and rolled back"),
    ("heals", "heals", "Groups healed from a live peer's global state"),
    ("failures", "group_failures", "Groups declared failed"),
    ("rejected", "rejected_contributions", "Contributions rejected (non-finite or outlier norm)"),
    ("evicted", "evictions", "Members evicted from the membership"),
    ("caught_up", "catch_ups", "Exchanges a live group the grace window left out took at weight 0 (no restart)"),
)

# progress key -> (metric suffix, help); values are what rank 0 of a group last reported
_PROGRESS_GAUGES = (
    ("step", "step", "Inner steps done, as last reported by the group"),
    ("steps", "target_steps", "Inner steps the group will run"),
    ("tokens_per_s", "tokens_per_second", "Training throughput of the group (items/s) at its last report"),
    ("utilization", "utilization_ratio", "Fraction of the group's wall time spent in inner steps"),
    ("loss", "train_loss", "Smoothed training loss the group last reported"),
    ("h", "sync_period_steps", "H: inner steps between syncs the group last reported"),
)


def _number(value: Any) -> float | None:
    """A finite float from an untrusted reported value, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def certificate_expiry(certificates: dict[str, bytes]) -> list[tuple[str, str, float]]:
    """``(file, subject, notAfter as Unix seconds)`` of every certificate in each PEM text of
    ``certificates`` (file name -> PEM bytes; a CA file may hold several during a rotation).
    ValueError naming the file if one holds no certificate."""
    from cryptography import x509

    out = []
    for name, pem in certificates.items():
        try:
            certs = x509.load_pem_x509_certificates(pem)
        except ValueError as e:
            raise ValueError(f"{name}: no PEM certificate in it ({e})") from None
        for cert in certs:
            out.append((name, cert.subject.rfc4514_string(), cert.not_valid_after_utc.timestamp()))
    return out


class CoordinatorCollector:
    """A prometheus-client collector that turns each snapshot into the ``diloco_coordinator_*``
    series; group ids become the ``group`` label. ``certificates``: the coordinator's TLS files
    (name -> PEM bytes, e.g. ``{"cert": ..., "ca": ...}``), whose expiry it exports."""

    def __init__(self, snapshot: Snapshot, certificates: dict[str, bytes] | None = None) -> None:
        self._snapshot = snapshot
        self._expiry = certificate_expiry(certificates or {})

    def describe(self) -> list[Metric]:
        return []  # not known before a snapshot; skips the registry's collect-on-register

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        groups = snap.get("groups", {})
        ended = _finished(snap)
        failed: dict[int, int] = {}
        for member in snap.get("failed", []):
            failed[member["group"]] = failed.get(member["group"], 0) + 1

        def job_gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"diloco_coordinator_{name}", doc, value=value)

        if self._expiry:
            expiry = GaugeMetricFamily("diloco_coordinator_tls_certificate_expiry_timestamp_seconds",
                                       "When a certificate of the coordinator's TLS files stops being valid "
                                       "(Unix time): connections after it are refused", labels=["file", "subject"])
            for name, subject, not_after in self._expiry:
                expiry.add_metric([name, subject], not_after)
            yield expiry
        yield job_gauge("expected_groups", "Groups the job waits for", snap.get("expected_groups", 0))
        yield job_gauge("epoch", "Membership epoch (0 before the quorum first forms)", snap.get("epoch", 0))
        yield job_gauge("quorum_complete", "1 once every expected group has joined", int(bool(snap.get("complete"))))
        rounds_state = snap.get("rounds_state") or {}
        live = rounds_state.get("live_groups")
        if live is None:
            live = [g for g, info in groups.items() if len(info.get("ranks", {})) > failed.get(g, 0)]
        last_quorum = rounds_state.get("last_quorum") or {}
        yield job_gauge("quorum_groups", "Groups in the latest quorum (without fault tolerance: joined "
                        "groups with a rank not marked failed)", len(last_quorum.get("groups", live)))
        if rounds_state:
            yield job_gauge("live_groups", "Groups the coordinator considers alive", len(live))
            yield job_gauge("healing_groups", "Groups fetching the global state from a live peer",
                            len(rounds_state.get("healing_groups", [])))
            yield job_gauge("joined_late_groups", "Groups told the job had finished when they asked to heal "
                            "(a restart after the others ended: they hold no model)",
                            len(rounds_state.get("joined_late", [])))
            yield job_gauge("job_lost", "1 once every group failed at once: no group holds the job's state; "
                            "resume from checkpoint", int(bool(rounds_state.get("job_lost"))))
            yield job_gauge("job_halted", "1 once the members differed with no majority again: the job stopped, "
                            "no restart mends it (diloco status says why)", int(bool(rounds_state.get("halted"))))
            for key, name, doc in _ROUND_COUNTS:
                value = _number(rounds_state.get(key))
                if value is not None:
                    yield CounterMetricFamily(f"diloco_coordinator_{name}", doc, value=value)
        yield job_gauge("stopped_groups", "Groups stopped by their own SIGTERM (a deleted pod) that have not "
                        "joined again: the job waits for them", len(snap.get("summaries", {})) - len(ended))
        yield job_gauge("finished_groups", "Groups that ended for good: trained to the end or joined too late "
                        "(not one stopped by its own SIGTERM: it comes back)", len(ended))
        yield job_gauge("diverged_rounds", "Rounds whose global-parameter hashes differed across groups",
                        len(snap.get("divergence", [])))
        yield job_gauge("plan_version", "Version of the bandwidth table the stripe plans use", snap.get("plan_version", 0))

        per_group = {
            "size": GaugeMetricFamily("diloco_coordinator_group_size", "Ranks the group declared", labels=["group"]),
            "joined": GaugeMetricFamily("diloco_coordinator_group_joined_ranks", "Ranks of the group that joined",
                                        labels=["group"]),
            "failed": GaugeMetricFamily("diloco_coordinator_group_failed_ranks",
                                        "Ranks of the group marked failed (silent past the heartbeat timeout)",
                                        labels=["group"]),
        }
        for g, info in sorted(groups.items()):
            per_group["size"].add_metric([str(g)], info.get("group_size", 0))
            per_group["joined"].add_metric([str(g)], len(info.get("ranks", {})))
            per_group["failed"].add_metric([str(g)], failed.get(g, 0))
        yield from per_group.values()

        position = GaugeMetricFamily("diloco_coordinator_group_ring_position",
                                     "Position of the group in the ring order (0 = first)", labels=["group"])
        for i, g in enumerate(snap.get("ring_order", [])):
            position.add_metric([str(g)], i)
        yield position

        rounds = GaugeMetricFamily("diloco_coordinator_group_round",
                                   "Last outer round the group reported committed", labels=["group"])
        for g, r in sorted(snap.get("rounds", {}).items()):
            rounds.add_metric([str(g)], r)
        yield rounds

        progress = snap.get("progress", {})
        for key, suffix, doc in _PROGRESS_GAUGES:
            family = GaugeMetricFamily(f"diloco_coordinator_group_{suffix}", doc, labels=["group"])
            for g, p in sorted(progress.items()):
                value = _number(p.get(key))
                if value is not None:
                    family.add_metric([str(g)], value)
            yield family
        sent = CounterMetricFamily("diloco_coordinator_group_sent_bytes",
                                   "Bytes the group sent to other groups, as of its last committed round",
                                   labels=["group"])
        for g, p in sorted(progress.items()):
            value = _number(p.get("bytes_sent"))
            if value is not None:
                sent.add_metric([str(g)], value)
        yield sent

        finished = GaugeMetricFamily("diloco_coordinator_group_finished",
                                     "1 once the group ended for good (trained to the end or joined too late)",
                                     labels=["group"])
        for g in sorted(groups):
            finished.add_metric([str(g)], int(g in ended))
        yield finished

        bandwidth = GaugeMetricFamily(
            "diloco_coordinator_link_bandwidth_bytes_per_second",
            "Latest measured bandwidth of a rank's data-plane link to a peer group (probe, bytes/s)",
            labels=["group", "rank", "peer_group"])
        for g, by_rank in sorted(snap.get("bandwidth", {}).items()):
            for r, rates in sorted(by_rank.items()):
                for peer, rate in sorted(rates.items()):
                    value = _number(rate)
                    if value is not None:
                        bandwidth.add_metric([str(g), str(r), str(peer)], value)
        yield bandwidth


def _finished(snap: dict[str, Any]) -> set[int]:
    """The groups that ended for good (``rounds.job_finished``'s rule): trained or joined too late."""
    return {g for g, s in snap.get("summaries", {}).items() if rounds.summary_kind(s) != rounds.STOPPED}


def status_document(snap: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """The JSON-able status of the job (``/status``) from a coordinator snapshot.

    Keys: version, time (unix s), expected_groups, epoch, complete, ring_order, plan_version,
    finished_groups, groups (a list: group, size, joined, failed, round, finished, ended (how its
    summary says it ended: ``trained``, ``stopped`` by its own SIGTERM, ``late``; None before), progress, ranks
    [{rank, address, step, failed, silent_s}]), bandwidth (a list: group, rank, peer_group,
    bytes_per_second), failed, divergence, rounds_state (a fault-tolerant coordinator's live,
    healing and failed groups, counts and last quorum, as its snapshot has them; else None).
    """
    failed = {(m["group"], m["rank"]): m.get("silent_s") for m in snap.get("failed", [])}
    steps = snap.get("steps", {})
    summaries, ended = snap.get("summaries", {}), _finished(snap)
    groups = []
    for g, info in sorted(snap.get("groups", {}).items()):
        ranks = [{"rank": r, "address": address, "step": steps.get(g, {}).get(r),
                  "failed": (g, r) in failed, "silent_s": failed.get((g, r))}
                 for r, address in sorted(info.get("ranks", {}).items())]
        groups.append({
            "group": g, "size": info.get("group_size", 0), "joined": len(ranks),
            "failed": sum(1 for r in ranks if r["failed"]), "round": snap.get("rounds", {}).get(g),
            "finished": g in ended, "progress": dict(snap.get("progress", {}).get(g, {})),
            "ended": rounds.summary_kind(summaries[g]) if g in summaries else None,
            "ranks": ranks,
        })
    bandwidth = [{"group": g, "rank": r, "peer_group": peer, "bytes_per_second": rate}
                 for g, by_rank in sorted(snap.get("bandwidth", {}).items())
                 for r, rates in sorted(by_rank.items()) for peer, rate in sorted(rates.items())]
    return {
        "version": STATUS_VERSION, "time": time.time() if now is None else now,
        "expected_groups": snap.get("expected_groups"), "epoch": snap.get("epoch"),
        "complete": bool(snap.get("complete")), "ring_order": list(snap.get("ring_order", [])),
        "plan_version": snap.get("plan_version"), "finished_groups": len(ended),
        "groups": groups, "bandwidth": bandwidth,
        "failed": list(snap.get("failed", [])), "divergence": list(snap.get("divergence", [])),
        "rounds_state": snap.get("rounds_state"),
    }


class CoordinatorHttp:
    """Serves ``/metrics``, ``/status`` and ``/healthz`` for a coordinator on background threads.

    ``snapshot``: ``CoordinatorServer.snapshot``; ``stopped``: returns True once the service is
    shutting down (``/healthz`` then answers 503). ``token``: required on ``/status`` if set.
    ``certificates``: TLS files (name -> PEM bytes) whose expiry ``/metrics`` exports.
    """

    def __init__(self, snapshot: Snapshot, *, host: str = "0.0.0.0", port: int = 0,
                 token: str | None = None, stopped: Callable[[], bool] = lambda: False,
                 certificates: dict[str, bytes] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(CoordinatorCollector(snapshot, certificates))
        self._snapshot, self._token, self._stopped = snapshot, token, stopped
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="coordinator-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port."""
        return self._httpd.server_address[1]

    def close(self) -> None:
        """Stop serving. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join()

    def __enter__(self) -> CoordinatorHttp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _authorized(self, header: str | None) -> bool:
        if self._token is None:
            return True
        return header is not None and hmac.compare_digest(header.encode(), f"Bearer {self._token}".encode())

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, CONTENT_TYPE_LATEST, generate_latest(outer.registry))
                elif path == "/status":
                    if not outer._authorized(self.headers.get("Authorization")):
                        self._reply(401, "text/plain", b"missing or wrong token (Authorization: Bearer ...)\n")
                        return
                    body = json.dumps(status_document(outer._snapshot()), indent=1).encode()
                    self._reply(200, "application/json", body)
                elif path == "/healthz":
                    ok = not outer._stopped()
                    self._reply(200 if ok else 503, "text/plain", b"ok\n" if ok else b"stopping\n")
                else:
                    self._reply(404, "text/plain", b"not found: try /metrics, /status or /healthz\n")

            def _reply(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass  # scrapes every few seconds would flood the coordinator's log

        return Handler


def serve(server: Any, *, host: str, port: int, token: str | None = None,
          certificates: dict[str, bytes] | None = None) -> CoordinatorHttp:
    """Serve a ``CoordinatorServer``'s metrics and status on ``host:port`` (0 = any free port);
    ``certificates``: its TLS files (name -> PEM bytes), whose expiry it exports."""
    return CoordinatorHttp(server.snapshot, host=host, port=port, token=token, stopped=lambda: server.stopped,
                           certificates=certificates)
