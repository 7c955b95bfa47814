"""Prometheus: the rules pass promtool, the exposition passes promtool's linter, and a real
Prometheus server scrapes a short `diloco run` (workers and coordinator) and answers queries."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from diloco_helpers import free_port, free_port_range
from ops_helpers import DEPLOY, SNAPSHOT, need_binary
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from diloco.coordinator.metrics import CoordinatorCollector
from diloco.runtime.ops.metrics import WorkerMetrics

PROM = DEPLOY / "prometheus"
RULES = PROM / "diloco-rules.yml"
RULE_FILES = sorted(p for p in PROM.glob("diloco-*.yml") if not p.name.endswith(".test.yml"))
RULE_TESTS = PROM / "diloco-rules.test.yml"
HOW = "Debian: apt-get install prometheus (.ci/run does)"
SMALL = ["--n-layer", "1", "--n-embd", "64", "--block-size", "32", "--batch-size", "8", "--eval-batches", "4",
         "--warmup-steps", "5"]


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    promtool = need_binary("promtool", HOW)
    return subprocess.run([promtool, *args], input=stdin, capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check():
    assert len(RULE_FILES) >= 4, RULE_FILES
    result = _promtool("check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_rule_file_is_loaded_by_a_datacenters_prometheus_and_unit_tested():
    import yaml

    tested = set(yaml.safe_load(RULE_TESTS.read_text())["rule_files"])
    loaded = set()
    for config in PROM.glob("prometheus-*.yml"):
        loaded |= set(yaml.safe_load(config.read_text())["rule_files"])
    assert {p.name for p in RULE_FILES} == tested == loaded


def test_rules_pass_their_promtool_unit_tests():
    result = _promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_exposition_passes_promtools_metric_linter(tmp_path):
    subprocess.run([sys.executable, "-m", "transport.certs", str(tmp_path), "--name", "coordinator"], check=True,
                   capture_output=True, timeout=60)
    certs = {"cert": (tmp_path / "coordinator.pem").read_bytes(), "ca": (tmp_path / "ca.pem").read_bytes()}
    worker = WorkerMetrics(group=0, rank=0, codec="int8", link="tcp", zstd=False, chunk_bytes=1 << 20)
    coordinator = CollectorRegistry()
    coordinator.register(CoordinatorCollector(lambda: SNAPSHOT, certs))
    for registry in (worker.registry, coordinator):
        text = generate_latest(registry).decode()
        result = _promtool("check", "metrics", stdin=text)
        assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
            result.stdout + result.stderr


def _query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_prometheus_scrapes_a_diloco_run_and_answers_queries(tmp_path: Path):
    prometheus = need_binary("prometheus", HOW)
    metrics = free_port_range(3)  # group 0's rank, group 1's rank, the coordinator
    prom_port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [
            {"job_name": "diloco-worker", "static_configs": [
                {"targets": [f"127.0.0.1:{metrics + g}"], "labels": {"group": str(g)}} for g in (0, 1)],
             "honor_labels": True},
            {"job_name": "diloco-coordinator", "static_configs": [{"targets": [f"127.0.0.1:{metrics + 2}"]}]},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    prom_log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                             "--log.level=warn"], stdout=prom_log, stderr=subprocess.STDOUT)
    run = subprocess.Popen(
        [sys.executable, "-m", "diloco", "run", *SMALL, "--steps", "1000", "--h", "10", "--groups", "2",
         "--ranks-per-group", "1", "--codec", "int8", "--metrics-port", str(metrics), "--log-format", "json",
         "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "summary.json"), "--run-timeout", "150"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{prom_port}"
    status_doc = None
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            time.sleep(1)
            try:
                stepped = _query(base, "max_over_time(diloco_inner_steps_total[10m]) > 0")
                joined = _query(base, "max_over_time(diloco_coordinator_quorum_complete[10m]) == 1")
            except OSError:  # Prometheus still starting
                continue
            if status_doc is None and joined and run.poll() is None:
                from diloco.runtime.ops.status import fetch

                try:
                    status_doc = fetch(f"127.0.0.1:{metrics + 2}",  # diloco run's /status asks for the job token
                                       token_file=str(tmp_path / "run" / "coordinator-token"))
                except RuntimeError:
                    pass
            if len(stepped) == 2 and joined and status_doc is not None and status_doc["complete"]:
                break
            assert run.poll() is None or run.returncode == 0, run.stdout.read().decode()[-3000:]
        else:
            pytest.fail("Prometheus saw no training within 150 s: " + (tmp_path / "prometheus.log").read_text()[-2000:])
        assert {r["metric"]["group"] for r in stepped} == {"0", "1"}
        assert {r["metric"]["job"] for r in stepped} == {"diloco-worker"}
        up = _query(base, 'max_over_time(up{job=~"diloco-.*"}[10m])')
        assert sorted(r["metric"]["job"] for r in up if r["value"][1] == "1") == [
            "diloco-coordinator", "diloco-worker", "diloco-worker"]
        info = _query(base, 'max_over_time(diloco_worker_info{codec="int8", link="tcp"}[10m])')
        assert len(info) == 2
        links = _query(base, "max_over_time(diloco_coordinator_link_bandwidth_bytes_per_second[10m])")
        assert {(r["metric"]["group"], r["metric"]["peer_group"]) for r in links} == {("0", "1"), ("1", "0")}
        assert all(float(r["value"][1]) > 0 for r in links)
        assert run.wait(120) == 0, run.stdout.read().decode()[-3000:]
        time.sleep(2)  # one more rule evaluation
        with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=5) as reply:
            groups = json.loads(reply.read())["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        in_file = sum(len(re.findall(r"^\s+- (?:alert|record): ", p.read_text(), flags=re.M)) for p in RULE_FILES)
        assert len(rules) == in_file and all(r["health"] == "ok" for r in rules), rules
        sent = _query(base, "max_over_time(diloco_wire_sent_bytes_total[10m])")
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert 0 < sum(float(r["value"][1]) for r in sent) <= summary["bytes_sent"]
    finally:
        _stop(run, signal.SIGINT)
        _stop(prom)
        prom_log.close()
    assert status_doc["expected_groups"] == 2 and [g["group"] for g in status_doc["groups"]] == [0, 1]
    assert status_doc["ring_order"] and {b["peer_group"] for b in status_doc["bandwidth"]} == {0, 1}
    for g in (0, 1):  # every line a worker wrote is a JSON record naming its group and rank
        lines = (tmp_path / "run" / f"group-{g}.log").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert records and all(r["group"] == g and r["rank"] == 0 and r["component"] == "worker" for r in records)
