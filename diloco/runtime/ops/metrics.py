"""Prometheus metrics of one worker rank, served over HTTP when a port is configured.

    diloco worker ... --metrics-port 9300     # then scrape http://HOST:9300/metrics

Names follow the Prometheus conventions: base units in the name (``_seconds``, ``_bytes``,
``_ratio``), ``_total`` on counters (added by prometheus-client on exposition: the attribute
``inner_steps`` is exposed as ``diloco_inner_steps_total``). Every series carries ``group`` and
``rank`` labels. Counters only go up; the bytes are what this rank's data plane put on (or took
off) the wire between groups, framing included. ``WORKER_SERIES`` lists every name exposed, and
``docs/operations.md`` explains each one.

The fault-tolerance series (``rounds_committed`` ... ``quorum_groups``, ``stall_seconds``) exist
from the start at 0 so dashboards and alerts can name them; the code that commits, rolls back and
heals rounds increments them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Info,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from transport.link_spec import DEFAULT_CHUNK_BYTES

disable_created_metrics()  # no *_created series: Prometheus does not use them, they double the count

# name as exposed -> type; the single list the docs, dashboard and rules are checked against
WORKER_SERIES: dict[str, str] = {
    "diloco_inner_steps_total": "counter",
    "diloco_outer_syncs_total": "counter",
    "diloco_wire_sent_bytes_total": "counter",
    "diloco_wire_received_bytes_total": "counter",
    "diloco_compute_seconds_total": "counter",
    "diloco_sync_seconds_total": "counter",
    "diloco_stall_seconds_total": "counter",
    "diloco_rounds_committed_total": "counter",
    "diloco_rounds_rolled_back_total": "counter",
    "diloco_heals_total": "counter",
    "diloco_group_failures_total": "counter",
    "diloco_rejected_contributions_total": "counter",
    "diloco_listener_refusals_total": "counter",
    "diloco_quorum_groups": "gauge",
    "diloco_compute_utilization_ratio": "gauge",
    "diloco_train_loss": "gauge",
    "diloco_sync_period_steps": "gauge",
    "diloco_inner_lr": "gauge",
    "diloco_codec_compression_ratio": "gauge",
    "diloco_worker_info": "gauge",
    "diloco_auto_info": "gauge",
}


#: reason label of diloco_listener_refusals_total -> the transport's cumulative counter of it
LISTENER_REFUSALS = {"rejected_connection": "rejected_connections", "handshake_timeout": "handshake_timeouts",
                     "ignored_message": "ignored_messages", "dropped_pending": "dropped_pending_messages"}

#: the transport's cumulative byte counters (wire_totals)
WIRE_COUNTERS = ("bytes_sent", "bytes_received")


def read_counters(transport: Any, names: Iterable[str]) -> dict[str, int]:
    """The transport's cumulative counters ``names`` (bytes, or counts of events): one
    ``counters()`` call when it has that method (``transport.ProcessTransport``, where each
    attribute read is a round trip to its data-plane process), else its attributes."""
    counters = getattr(transport, "counters", None)
    if callable(counters):
        every = counters()
        return {name: int(every[name]) for name in names}
    return {name: int(getattr(transport, name)) for name in names}


class _Seconds:
    """A seconds counter that also keeps its own running total (for the utilization gauge)."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter
        self._lock = threading.Lock()
        self.total = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self._counter.inc(amount)
        with self._lock:
            self.total += amount


class WorkerMetrics:
    """The series a worker updates; ``serve()`` exposes them on ``/metrics``.

    ``codec``/``codec_block``/``link``/``zstd``/``chunk_bytes``: the wire settings (as the flags of
    the same names), shown as ``diloco_worker_info``
    labels and the codec's compression ratio; when not given, those of :func:`describe_process`
    (``diloco worker`` sets them from its configuration), else the series are left out.
    """

    def __init__(self, group: int, rank: int, *, codec: str | None = None, codec_block: int | None = None,
                 link: str | None = None, zstd: bool | None = None, chunk_bytes: int | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = {"group": str(group), "rank": str(rank)}
        names = list(labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        self.inner_steps = counter("diloco_inner_steps", "Inner optimizer steps taken")
        self.outer_rounds = counter("diloco_outer_syncs", "Pseudo-gradient exchanges launched (fragment syncs)")
        self.bytes_sent = counter("diloco_wire_sent_bytes", "Bytes sent to other groups, framing included")
        self.bytes_received = counter("diloco_wire_received_bytes", "Bytes received from other groups, framing included")
        self.compute_seconds = _Seconds(counter("diloco_compute_seconds", "Seconds spent in inner steps"))
        self.sync_seconds = _Seconds(counter("diloco_sync_seconds", "Seconds the training loop waited on syncs"))
        self.stall_seconds = counter(
            "diloco_stall_seconds", "Seconds training could not proceed for want of a quorum or a peer "
            "(waiting for membership, heals, rejoins)")
        self.rounds_committed = counter("diloco_rounds_committed", "Outer rounds committed by this rank")
        self.rounds_rolled_back = counter("diloco_rounds_rolled_back", "Outer rounds abandoned and rolled back")
        self.heals = counter("diloco_heals", "Times this rank fetched the global state from a live peer")
        self.group_failures = counter("diloco_group_failures", "Peer groups this rank saw fail")
        self.rejected_contributions = counter(
            "diloco_rejected_contributions", "Pseudo-gradient contributions refused (stale, non-finite, wrong round)")
        self._refusals = Counter(
            "diloco_listener_refusals", "What this rank's data-plane listener refused or dropped from peers, by reason: "
            "rejected_connection (over a cap on unauthenticated connections), handshake_timeout, ignored_message "
            "(data or an abort not from the collective's proven left neighbour), dropped_pending (frames for "
            "exchanges not started here, over the pending bound)", names + ["reason"], registry=self.registry)
        self._refusal_labels = labels
        for reason in LISTENER_REFUSALS:
            self._refusals.labels(**labels, reason=reason)
        self.quorum_groups = gauge("diloco_quorum_groups", "Groups in the quorum of the current round")
        self.loss = gauge("diloco_train_loss", "Smoothed inner training loss (nats/token for the demo)")
        self.sync_period = gauge("diloco_sync_period_steps", "H: inner steps between syncs of a fragment")
        self.inner_lr = gauge("diloco_inner_lr", "Current inner learning rate")
        started = time.monotonic()
        gauge("diloco_compute_utilization_ratio",
              "Fraction of wall time since the rank started spent in inner steps").set_function(
            lambda: self.compute_seconds.total / max(time.monotonic() - started, 1e-9))
        ProcessCollector(registry=self.registry)
        self._describe_wire(labels, {**_process_wire, **{k: v for k, v in {
            "codec": codec, "codec_block": codec_block, "link": link, "zstd": zstd,
            "chunk_bytes": chunk_bytes}.items() if v is not None}})
        self._auto = Info("diloco_auto", "What --codec auto / --h auto chose and why (value 1; state off without auto)",
                          list(labels), registry=self.registry).labels(**labels)
        self._auto.info({"state": "off"})
        self._seen = {"sent": 0, "received": 0, **{r: 0 for r in LISTENER_REFUSALS}}
        self.server: Any = None

    def _describe_wire(self, labels: dict[str, str], wire: dict[str, Any]) -> None:
        if "codec" not in wire:
            return
        self._wire = wire
        self._wire_info = Info("diloco_worker", "Wire settings of this rank (value 1)", list(labels),
                               registry=self.registry).labels(**labels)
        self._ratio = Gauge("diloco_codec_compression_ratio", "fp32 bytes per wire byte of one full chunk's frame "
                            "(before the optional zstd stage)", list(labels), registry=self.registry).labels(**labels)
        self._show_codec(str(wire["codec"]), int(wire.get("codec_block", 0)))

    def _show_codec(self, codec: str, codec_block: int) -> None:
        w = self._wire
        self._wire_info.info({"codec": codec, "link": str(w.get("link", "")), "zstd": str(bool(w.get("zstd", False))).lower()})
        if codec != "auto":  # auto: set once the worker has chosen (``auto_decided``)
            self._ratio.set(codec_ratio(codec, int(w.get("chunk_bytes", DEFAULT_CHUNK_BYTES)), codec_block))

    def auto_decided(self, labels: dict[str, str]) -> None:
        """``--codec auto`` / ``--h auto`` decided: ``diloco_auto_info`` shows the setting and its
        reason (``labels``), and the wire series the chosen codec."""
        self._auto.info({"state": "decided", **labels})
        if hasattr(self, "_wire"):
            self._show_codec(labels["codec"], 0)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP endpoint on ``host`` (the rank's ``--host``; port 0 = any free port);
        returns the bound port."""
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self.server.server_port

    def wire_totals(self, sent: int, received: int) -> None:
        """Record the transport's cumulative byte counters."""
        self.bytes_sent.inc(max(sent - self._seen["sent"], 0))
        self.bytes_received.inc(max(received - self._seen["received"], 0))
        self._seen.update(sent=sent, received=received)

    def listener_totals(self, transport: Any) -> None:
        """Record the transport's cumulative refusal counters (``LISTENER_REFUSALS``), read at once."""
        self._refusal_totals(read_counters(transport, LISTENER_REFUSALS.values()))

    def transport_totals(self, transport: Any) -> None:
        """Record the transport's cumulative byte and refusal counters, read at once (``wire_totals``
        and ``listener_totals`` in one read)."""
        counts = read_counters(transport, (*WIRE_COUNTERS, *LISTENER_REFUSALS.values()))
        self.wire_totals(counts["bytes_sent"], counts["bytes_received"])
        self._refusal_totals(counts)

    def _refusal_totals(self, counts: dict[str, int]) -> None:
        for reason, name in LISTENER_REFUSALS.items():
            value = counts[name]
            self._refusals.labels(**self._refusal_labels, reason=reason).inc(max(value - self._seen[reason], 0))
            self._seen[reason] = value

    def close(self) -> None:
        """Stop the HTTP endpoint. Idempotent."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


_process_wire: dict[str, Any] = {}


def describe_process(*, codec: str, codec_block: int, link: str, zstd: bool, chunk_bytes: int) -> None:
    """Wire settings for every ``WorkerMetrics`` this process makes later without its own."""
    _process_wire.update(codec=codec, codec_block=codec_block, link=link, zstd=zstd, chunk_bytes=chunk_bytes)


def codec_ratio(codec: str, chunk_bytes: int, codec_block: int = 0) -> float:
    """fp32 bytes over frame bytes for one chunk of ``chunk_bytes`` of fp32 input, before zstd
    (``codec_block`` 0: the codec's default block)."""
    from compress.codec_spec import CodecSpec

    count = max(chunk_bytes // 4, 1)
    return 4 * count / CodecSpec(codec=codec, codec_block=codec_block).build().frame_size(count)
