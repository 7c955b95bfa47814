"""Metric names and values: worker series (diloco.runtime.ops.metrics) and the coordinator's (diloco.coordinator.metrics)."""

from __future__ import annotations

import re
import time

import pytest
from ops_helpers import SNAPSHOT
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from diloco.coordinator.metrics import COORDINATOR_SERIES, CoordinatorCollector
from diloco.runtime.ops.metrics import (
    WIRE_COUNTERS,
    WORKER_SERIES,
    WorkerMetrics,
    codec_ratio,
    read_counters,
)
from transport.control import COUNTERS


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


def _exposed(registry: CollectorRegistry) -> dict[str, str]:
    """Exposed family name -> type, from the text format (what Prometheus reads)."""
    text = generate_latest(registry).decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))


def _coordinator_registry(snapshot: dict, certificates: dict[str, bytes] | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(lambda: snapshot, certificates))
    return registry


@pytest.fixture(scope="module")
def coordinator_certificates(tmp_path_factory) -> dict[str, bytes]:
    """A 30-day certificate and its CA, as ``python -m transport.certs`` makes them."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("pki")
    subprocess.run([sys.executable, "-m", "transport.certs", str(out), "--name", "coordinator", "--days", "30"],
                   check=True, capture_output=True, timeout=60)
    return {"cert": (out / "coordinator.pem").read_bytes(), "ca": (out / "ca.pem").read_bytes()}


def test_worker_series_are_the_documented_list_and_follow_the_conventions():
    m = WorkerMetrics(group=1, rank=2, codec="int8", link="tcp", zstd=False, chunk_bytes=1 << 20)
    exposed = {name: kind for name, kind in _exposed(m.registry).items() if name.startswith("diloco_")}
    assert exposed == WORKER_SERIES
    _check_conventions(exposed)
    for (name, labels), _ in _samples(m.registry).items():
        if name.startswith("diloco_"):
            assert ("group", "1") in labels and ("rank", "2") in labels, name


def test_coordinator_series_are_the_documented_list_and_follow_the_conventions(coordinator_certificates):
    exposed = _exposed(_coordinator_registry(SNAPSHOT, coordinator_certificates))
    assert exposed == COORDINATOR_SERIES
    _check_conventions(exposed)


def test_coordinator_exports_when_its_certificates_expire(coordinator_certificates):
    import time

    from diloco.coordinator.metrics import certificate_expiry

    samples = _samples(_coordinator_registry(SNAPSHOT, coordinator_certificates))
    expiry = {dict(labels)["file"]: (dict(labels)["subject"], value) for (name, labels), value in samples.items()
              if name == "diloco_coordinator_tls_certificate_expiry_timestamp_seconds"}
    assert set(expiry) == {"cert", "ca"} and "coordinator" in expiry["cert"][0]
    for _, not_after in expiry.values():
        assert 29.9 < (not_after - time.time()) / 86400 <= 30.0
    assert not any(name.endswith("expiry_timestamp_seconds") for name, _ in _samples(_coordinator_registry(SNAPSHOT)))
    with pytest.raises(ValueError, match="cert: no PEM certificate"):
        certificate_expiry({"cert": b"not a certificate"})
    two = coordinator_certificates["ca"] + coordinator_certificates["cert"]  # a CA bundle during a rotation
    assert len(certificate_expiry({"ca": two})) == 2


def _check_conventions(series: dict[str, str]) -> None:
    for name, kind in series.items():
        assert re.fullmatch(r"diloco_[a-z0-9_]+", name), name
        assert name.endswith("_total") == (kind == "counter"), f"{name}: counters and only counters end in _total"
        for bad in ("_ms", "_milliseconds", "_kb", "_mb", "_gb", "_percent", "_minutes", "_hours", "_bits"):
            assert bad not in name, f"{name}: use base units (seconds, bytes, ratio)"
        if "second" in name and "per_second" not in name:
            assert re.search(r"_seconds(_total)?$", name), f"{name}: time in seconds, as the suffix"
        if "bytes" in name:
            assert re.search(r"_bytes(_total|_per_second)?$", name), f"{name}: the unit is the suffix"


def test_worker_fault_tolerance_series_start_at_zero_and_count():
    m = WorkerMetrics(group=0, rank=0)
    samples = _samples(m.registry)
    labels = (("group", "0"), ("rank", "0"))
    for name in ("diloco_rounds_committed_total", "diloco_rounds_rolled_back_total", "diloco_heals_total",
                 "diloco_group_failures_total", "diloco_rejected_contributions_total", "diloco_stall_seconds_total",
                 "diloco_quorum_groups"):
        assert samples[(name, labels)] == 0.0, name
    m.rounds_committed.inc()
    m.heals.inc(2)
    m.stall_seconds.inc(1.5)
    m.quorum_groups.set(3)
    samples = _samples(m.registry)
    assert samples[("diloco_rounds_committed_total", labels)] == 1
    assert samples[("diloco_heals_total", labels)] == 2
    assert samples[("diloco_stall_seconds_total", labels)] == 1.5
    assert samples[("diloco_quorum_groups", labels)] == 3


def test_compute_utilization_is_compute_seconds_over_wall_time():
    m = WorkerMetrics(group=0, rank=0)
    time.sleep(0.2)
    m.compute_seconds.inc(0.1)
    m.sync_seconds.inc(0.05)
    value = _samples(m.registry)[("diloco_compute_utilization_ratio", (("group", "0"), ("rank", "0")))]
    assert 0.1 / 1.0 < value < 0.1 / 0.2 + 1e-9
    assert _samples(m.registry)[("diloco_sync_seconds_total", (("group", "0"), ("rank", "0")))] == 0.05


def test_codec_series_name_the_codec_and_its_measured_frame_ratio():
    m = WorkerMetrics(group=0, rank=1, codec="int8", link="grpc", zstd=True, chunk_bytes=1 << 20)
    samples = _samples(m.registry)
    info = [labels for (name, labels) in samples if name == "diloco_worker_info"]
    assert info == [(("codec", "int8"), ("group", "0"), ("link", "grpc"), ("rank", "1"), ("zstd", "true"))]
    ratio = samples[("diloco_codec_compression_ratio", (("group", "0"), ("rank", "1")))]
    assert ratio == pytest.approx(codec_ratio("int8", 1 << 20))
    assert 3.8 < ratio < 4.0  # 8 bits per value plus one fp32 scale per 256 values and the frame header
    assert codec_ratio("fp32", 1 << 20) == pytest.approx(1.0, abs=1e-3)
    assert codec_ratio("int4", 1 << 20) > 7


def test_a_group_stopped_by_sigterm_is_not_finished_and_a_late_one_is_named():
    """Metrics, /status and `diloco status` tell a group that comes back (stopped by its own SIGTERM)
    from one that trained to the end and one that joined too late (it holds no model)."""
    from diloco.coordinator.metrics import status_document
    from diloco.runtime.ops.status import format_status

    groups = {g: {"ranks": {0: f"10.0.{g}.0:7000"}, "group_size": 1} for g in range(3)}
    snap = {**SNAPSHOT, "groups": groups, "rounds_state": {**SNAPSHOT["rounds_state"], "joined_late": [2]},
            "summaries": {0: {"param_hash": "h"}, 1: {"param_hash": "h", "stopped_by": "SIGTERM"},
                          2: {"joined_late": True}}}
    s = _samples(_coordinator_registry(snap))
    assert s[("diloco_coordinator_finished_groups", ())] == 2 and s[("diloco_coordinator_joined_late_groups", ())] == 1
    assert s[("diloco_coordinator_stopped_groups", ())] == 1
    assert [s[("diloco_coordinator_group_finished", (("group", str(g)),))] for g in range(3)] == [1, 0, 1]
    doc = status_document(snap)
    assert doc["finished_groups"] == 2
    assert [(g["finished"], g["ended"]) for g in doc["groups"]] == [(True, "trained"), (False, "stopped"),
                                                                      (True, "late")]
    text = format_status(doc)
    assert "stopped (SIGTERM; comes back)" in text and "joined late (no model)" in text


def test_coordinator_collector_reports_what_the_snapshot_holds():
    s = _samples(_coordinator_registry(SNAPSHOT))
    g = lambda n: (("group", str(n)),)  # noqa: E731
    assert s[("diloco_coordinator_quorum_complete", ())] == 1 and s[("diloco_coordinator_epoch", ())] == 1
    assert s[("diloco_coordinator_quorum_groups", ())] == 1  # the last quorum's groups
    assert s[("diloco_coordinator_live_groups", ())] == 1
    assert s[("diloco_coordinator_finished_groups", ())] == 1 and s[("diloco_coordinator_diverged_rounds", ())] == 1
    assert s[("diloco_coordinator_group_joined_ranks", g(0))] == 2 and s[("diloco_coordinator_group_size", g(1))] == 1
    assert s[("diloco_coordinator_group_failed_ranks", g(1))] == 1 and s[("diloco_coordinator_group_failed_ranks", g(0))] == 0
    assert s[("diloco_coordinator_group_ring_position", g(1))] == 0 and s[("diloco_coordinator_group_ring_position", g(0))] == 1
    assert s[("diloco_coordinator_group_round", g(0))] == 4 and s[("diloco_coordinator_group_step", g(1))] == 38
    assert s[("diloco_coordinator_group_tokens_per_second", g(0))] == 1234.5
    assert ("diloco_coordinator_group_tokens_per_second", g(1)) not in s  # not a number: left out
    assert ("diloco_coordinator_group_train_loss", g(1)) not in s  # NaN: left out
    assert s[("diloco_coordinator_group_sent_bytes_total", g(0))] == 5_000_000
    assert s[("diloco_coordinator_group_finished", g(0))] == 1 and s[("diloco_coordinator_group_finished", g(1))] == 0
    link = (("group", "0"), ("peer_group", "1"), ("rank", "1"))
    assert s[("diloco_coordinator_link_bandwidth_bytes_per_second", link)] == 1.0e8
    assert s[("diloco_coordinator_rounds_committed_total", ())] == 7
    assert s[("diloco_coordinator_rounds_rolled_back_total", ())] == 1


def test_coordinator_collector_without_fault_tolerance_counts_live_joined_groups():
    snap = {k: v for k, v in SNAPSHOT.items() if k != "rounds_state"}
    s = _samples(_coordinator_registry(snap))
    assert s[("diloco_coordinator_quorum_groups", ())] == 1  # group 1's only rank failed
    assert not any(name.startswith("diloco_coordinator_rounds_") for name, _ in s)
    empty = _samples(_coordinator_registry({}))  # before anything joined
    assert empty[("diloco_coordinator_quorum_groups", ())] == 0


def test_listener_refusals_follow_the_transports_counters():
    class FakeTransport:
        rejected_connections, handshake_timeouts, ignored_messages, dropped_pending_messages = 3, 1, 0, 7

    m = WorkerMetrics(group=0, rank=0)
    t = FakeTransport()
    m.listener_totals(t)
    m.wire_totals(10, 20)  # the two kinds of totals keep their own baselines
    t.rejected_connections = 5
    m.listener_totals(t)
    got = {dict(labels)["reason"]: v for (name, labels), v in _samples(m.registry).items()
           if name == "diloco_listener_refusals_total"}
    assert got == {"rejected_connection": 5, "handshake_timeout": 1, "ignored_message": 0, "dropped_pending": 7}


def test_transport_counters_are_read_in_one_request_when_the_transport_offers_it():
    """``transport.ProcessTransport``: every counter attribute is a round trip to its data-plane
    process; ``counters()`` returns them all (the keys of ``transport.control.COUNTERS``) in one."""

    class ProcessLikeTransport:
        def __init__(self) -> None:
            self.requests = 0
            self.values = dict.fromkeys(COUNTERS, 0)

        def counters(self) -> dict[str, int]:
            self.requests += 1
            return dict(self.values)

        def __getattr__(self, name: str):
            raise AssertionError(f"read {name} as an attribute: one request each")

    m = WorkerMetrics(group=0, rank=0)
    t = ProcessLikeTransport()
    t.values.update(rejected_connections=3, handshake_timeouts=1, dropped_pending_messages=7)
    m.listener_totals(t)
    assert t.requests == 1
    t.values.update(bytes_sent=1000, bytes_received=400, rejected_connections=5, ignored_messages=2)
    m.transport_totals(t)
    assert t.requests == 2
    assert read_counters(t, WIRE_COUNTERS) == {"bytes_sent": 1000, "bytes_received": 400}
    s = _samples(m.registry)
    labels = (("group", "0"), ("rank", "0"))
    assert s[("diloco_wire_sent_bytes_total", labels)] == 1000
    assert s[("diloco_wire_received_bytes_total", labels)] == 400
    got = {dict(lab)["reason"]: v for (name, lab), v in s.items() if name == "diloco_listener_refusals_total"}
    assert got == {"rejected_connection": 5, "handshake_timeout": 1, "ignored_message": 2, "dropped_pending": 7}
