"""Generates diloco.json, the Grafana dashboard of a diloco job, from the metrics the code exports.

    python deploy/grafana/dashboard.py          # rewrites deploy/grafana/diloco.json

tests/ops/test_ops_grafana.py checks that the committed JSON is this script's output and that every
query names only series that diloco exports (``diloco.runtime.ops.metrics.WORKER_SERIES``,
``diloco.coordinator.metrics.COORDINATOR_SERIES``) or Prometheus' own ``up``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("diloco.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
GROUP = 'group=~"$group"'


def _panel(title: str, targets: list[tuple[str, str]], unit: str, *, kind: str = "timeseries",
           description: str = "") -> dict[str, Any]:
    return {
        "type": kind, "title": title, "description": description, "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "right"}} if kind == "timeseries" else {},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def _row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def panels() -> list[dict[str, Any]]:
    """Rows of panels: the job, per group, per link, fault tolerance."""
    rate = "[$__rate_interval]"
    rows: list[tuple[dict[str, Any], list[dict[str, Any]]]] = [
        (_row("Job (coordinator)"), [
            _panel("Groups in quorum", [("diloco_coordinator_quorum_groups", "in quorum"),
                                        ("diloco_coordinator_expected_groups", "expected")], "none", kind="stat"),
            _panel("Groups finished", [("diloco_coordinator_finished_groups", "finished")], "none", kind="stat"),
            _panel("Membership epoch", [("diloco_coordinator_epoch", "epoch")], "none", kind="stat"),
            _panel("Diverged rounds", [("diloco_coordinator_diverged_rounds", "diverged")], "none", kind="stat",
                   description="Rounds whose global-parameter hashes differed across groups: should stay 0"),
            _panel("Failed ranks", [("sum(diloco_coordinator_group_failed_ranks)", "failed")], "none", kind="stat"),
            _panel("Plan version", [("diloco_coordinator_plan_version", "plan")], "none", kind="stat"),
        ]),
        (_row("Per group"), [
            _panel("Outer round", [(f"diloco_coordinator_group_round{{{GROUP}}}", "group {{group}}")], "none"),
            _panel("Inner steps", [(f"diloco_coordinator_group_step{{{GROUP}}}", "group {{group}}"),
                                   (f"diloco_coordinator_group_target_steps{{{GROUP}}}", "target {{group}}")], "none"),
            _panel("Training loss", [(f"diloco_coordinator_group_train_loss{{{GROUP}}}", "group {{group}}")], "none"),
            _panel("Throughput", [(f"diloco_coordinator_group_tokens_per_second{{{GROUP}}}", "group {{group}}")],
                   "short", description="Items (tokens for the demo) per second of each group"),
            _panel("Compute utilization", [
                (f"avg by (group) (rate(diloco_compute_seconds_total{{{GROUP}}}{rate}))", "group {{group}}")],
                "percentunit", description="Fraction of wall time the ranks spend in inner steps"),
            _panel("Time waiting on syncs and stalls", [
                (f"avg by (group) (rate(diloco_sync_seconds_total{{{GROUP}}}{rate}))", "sync {{group}}"),
                (f"avg by (group) (rate(diloco_stall_seconds_total{{{GROUP}}}{rate}))", "stall {{group}}")],
                "percentunit"),
            _panel("H (inner steps per sync)", [
                (f"max by (group) (diloco_sync_period_steps{{{GROUP}}})", "group {{group}}")], "none"),
            _panel("Inner learning rate", [(f"max by (group) (diloco_inner_lr{{{GROUP}}})", "group {{group}}")],
                   "none"),
        ]),
        (_row("Links (each rank drives its own NIC)"), [
            _panel("Wire bytes sent per rank", [
                (f"rate(diloco_wire_sent_bytes_total{{{GROUP}}}{rate})", "{{group}}/{{rank}} sent"),
                (f"rate(diloco_wire_received_bytes_total{{{GROUP}}}{rate})", "{{group}}/{{rank}} received")],
                "Bps"),
            _panel("Measured link bandwidth", [
                (f"diloco_coordinator_link_bandwidth_bytes_per_second{{{GROUP}}}",
                 "{{group}}/{{rank}} -> group {{peer_group}}")],
                "Bps", description="Latest bandwidth probe of each rank's link to each peer group"),
            _panel("Bytes sent per group", [
                (f"rate(diloco_coordinator_group_sent_bytes_total{{{GROUP}}}{rate})", "group {{group}}")], "Bps"),
            _panel("Codec compression ratio", [
                (f"diloco_codec_compression_ratio{{{GROUP}}} * on (group, rank) group_left (codec) "
                 f"diloco_worker_info{{{GROUP}}}", "{{group}}/{{rank}} {{codec}}")],
                "none", description="fp32 bytes per wire byte of one chunk's frame"),
        ]),
        (_row("Fault tolerance"), [
            _panel("Rounds committed and rolled back", [
                (f"increase(diloco_coordinator_rounds_committed_total{rate})", "committed"),
                (f"increase(diloco_coordinator_rounds_rolled_back_total{rate})", "rolled back")], "none"),
            _panel("Heals, failures, rejections", [
                (f"increase(diloco_coordinator_heals_total{rate})", "heals"),
                (f"increase(diloco_coordinator_group_failures_total{rate})", "group failures"),
                (f"increase(diloco_coordinator_rejected_contributions_total{rate})", "rejected contributions")],
                "none"),
            _panel("Quorum seen by each rank", [(f"diloco_quorum_groups{{{GROUP}}}", "{{group}}/{{rank}}")], "none"),
            _panel("Targets up", [('up{job=~"diloco-.*"}', "{{job}} {{instance}}")], "none"),
        ]),
    ]
    out, y = [], 0
    for row, members in rows:
        row["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
        out.append(row)
        y += 1
        for i, p in enumerate(members):
            small = p["type"] == "stat"
            w, h = (4, 4) if small else (12, 8)
            per_line = 24 // w
            p["gridPos"] = {"h": h, "w": w, "x": (i % per_line) * w, "y": y + (i // per_line) * h}
            out.append(p)
        y += ((len(members) + per_line - 1) // per_line) * h
    for i, p in enumerate(out, start=1):
        p["id"] = i
    return out


def dashboard() -> dict[str, Any]:
    """The whole dashboard (Grafana 10+ JSON model)."""
    return {
        "title": "diloco", "uid": "diloco-job", "tags": ["diloco"], "schemaVersion": 39, "version": 1,
        "editable": True, "refresh": "30s", "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            {"name": "group", "label": "group", "type": "query", "datasource": DS, "includeAll": True,
             "multi": True, "current": {"text": "All", "value": "$__all"}, "allValue": ".*",
             "definition": "label_values(diloco_inner_steps_total, group)",
             "query": {"query": "label_values(diloco_inner_steps_total, group)", "refId": "group"}},
        ]},
        "panels": panels(),
    }


def render() -> str:
    """The dashboard as the committed file's text."""
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
