"""deploy/prometheus's configurations, run by real Prometheus servers on 127.0.0.1.

Kubernetes discovery cannot run here, so the pods' discovery labels are written as Kubernetes'
pod role makes them (one target per declared container port, ``__meta_kubernetes_pod_*``) into a
file_sd file, from the rendered overlays; the shipped relabeling then decides the targets. Every
target address is 127.0.0.1 (a closed port where nothing should be scraped). Datacenter B's
federation of the coordinator's series is run for real: A scrapes a coordinator exposition, B
federates it from A.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from diloco_helpers import free_port
from ops_helpers import DEPLOY, SNAPSHOT, need_binary

from diloco.coordinator.metrics import CoordinatorHttp

PROM = DEPLOY / "prometheus"
HOW = "Debian: apt-get install prometheus (.ci/run does)"

pytestmark = pytest.mark.slow


def _meta(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _pods(objects: list[dict]):
    """(pod name, phase, template) of every pod the workloads would make."""
    for obj in objects:
        if obj["kind"] == "Job":
            n = obj["spec"].get("completions", 1)
            for i in range(n):
                yield f"{obj['metadata']['name']}-{i}-x", "Running", obj, i
        elif obj["kind"] in ("Deployment", "StatefulSet"):
            for i in range(obj["spec"].get("replicas", 1)):
                yield f"{obj['metadata']['name']}-{i}", "Running", obj, i


def _sd_targets(objects: list[dict], ports: dict, phase: str | None = None) -> list[dict]:
    """File SD groups as Kubernetes' pod role would discover the rendered pods (addresses replaced
    by 127.0.0.1 ports from ``ports``, which records (pod, port name) for each)."""
    groups = []
    for pod, default_phase, obj, index in _pods(objects):
        template = obj["spec"]["template"]
        labels = dict(template["metadata"].get("labels", {}))
        if obj["kind"] == "Job":
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
        meta = {"__meta_kubernetes_namespace": obj["metadata"].get("namespace", "default"),
                "__meta_kubernetes_pod_name": pod, "__meta_kubernetes_pod_phase": phase or default_phase}
        meta.update({f"__meta_kubernetes_pod_label_{_meta(k)}": v for k, v in labels.items()})
        meta.update({f"__meta_kubernetes_pod_annotation_{_meta(k)}": v
                     for k, v in template["metadata"].get("annotations", {}).items()})
        for container in template["spec"]["containers"]:
            for port in container.get("ports", []):
                address = f"127.0.0.1:{len(ports) + 1}"  # privileged ports: nothing listens there
                ports[address] = (pod, port.get("name", ""))
                groups.append({"targets": [address], "labels": {
                    **meta, "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])}})
    return groups


def _with_file_sd(config: dict, sd: Path, interval: str = "1s") -> dict:
    """The shipped config with its Kubernetes discovery replaced by file_sd (same relabeling)."""
    config = json.loads(json.dumps(config))
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = interval
    config["rule_files"] = [str(PROM / f) for f in config["rule_files"]]
    for job in config["scrape_configs"]:
        job.pop("scrape_interval", None)
        if "kubernetes_sd_configs" in job:
            del job["kubernetes_sd_configs"]
            job["file_sd_configs"] = [{"files": [str(sd)]}]
    return config


class _Prometheus:
    def __init__(self, tmp: Path, name: str, config: dict) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        (self.dir / "prometheus.yml").write_text(json.dumps(config))
        promtool = need_binary("promtool", HOW)
        check = subprocess.run([promtool, "check", "config", str(self.dir / "prometheus.yml")], capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        prometheus = need_binary("prometheus", HOW)
        self.port = free_port()
        self.log = open(self.dir / "log", "wb")
        self.proc = subprocess.Popen([prometheus, f"--config.file={self.dir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={self.dir / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def wait(self, what: str, predicate, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                value = predicate()
            except OSError:
                value = None
            if value:
                return value
            time.sleep(0.5)
        pytest.fail(f"{what}: not within {timeout_s} s\n" + (self.dir / "log").read_text()[-3000:])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def test_every_local_rank_of_every_pod_is_a_target_and_finished_pods_are_not(tmp_path, rendered):
    config = yaml.safe_load((PROM / "prometheus-dc-a.yml").read_text())
    ports: dict[str, tuple[str, str]] = {}
    sd = tmp_path / "sd.json"
    groups = []
    for objects in rendered.values():  # both datacenters' pods, as if in one cluster's view
        groups += _sd_targets(objects, ports)
    finished = _sd_targets(rendered["dc-a"], ports, phase="Succeeded")
    for g in finished:  # a finished Job's pods under other names
        g["labels"]["__meta_kubernetes_pod_name"] += "-done"
    sd.write_text(json.dumps(groups + finished))
    expected = {}
    for objects in rendered.values():
        for pod, _, obj, _ in _pods(objects):
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            component = obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            for port in container["ports"]:
                if port["name"] == "metrics" or port["name"].startswith("metrics-"):
                    expected[(pod, port["name"])] = f"diloco-{component}"
    prom = _Prometheus(tmp_path, "prom", _with_file_sd(config, sd, interval="1h"))
    try:
        data = prom.wait("targets discovered", lambda: (lambda d: d if d["activeTargets"] else None)(
            prom.api("targets")))
    finally:
        prom.close()
    active = {(t["labels"]["pod"], ports[t["scrapeUrl"].split("/")[2]][1]): t["labels"] for t in data["activeTargets"]}
    assert set(active) == set(expected), f"scraped {sorted(active)}, want {sorted(expected)}"
    for key, labels in active.items():
        assert labels["job"] == expected[key]
        if labels["job"] == "diloco-worker":
            assert labels["group"] in ("0", "1") and labels["local_rank"] == key[1].split("-")[1]
            assert labels["datacenter"] in ("dc-a", "dc-b")
    workers = [k for k, v in expected.items() if v == "diloco-worker"]
    assert len(workers) == sum(int(next(e["value"] for e in o["spec"]["template"]["spec"]["containers"][0]["env"]
                                        if e["name"] == "DILOCO_RANKS_PER_NODE")) * o["spec"]["completions"]
                               for objects in rendered.values() for o in objects
                               if o["kind"] == "Job" and "-group-" in o["metadata"]["name"])


def test_the_second_datacenter_sees_the_coordinator_by_federation(tmp_path, rendered):
    """A scrapes a coordinator (its /metrics on 127.0.0.1, with its rendered pod's discovery
    labels); B, configured by prometheus-dc-b.yml, federates the coordinator's series from A."""
    subprocess.run([sys.executable, "-m", "transport.certs", str(tmp_path / "pki"), "--name", "coordinator"],
                   check=True, capture_output=True, timeout=60)
    certs = {"cert": (tmp_path / "pki" / "coordinator.pem").read_bytes(),
             "ca": (tmp_path / "pki" / "ca.pem").read_bytes()}
    coordinator = [o for o in rendered["dc-a"] if o["kind"] == "Job" and "coordinator" in o["metadata"]["name"]]
    with CoordinatorHttp(lambda: SNAPSHOT, host="127.0.0.1", port=0, certificates=certs) as http:
        ports: dict[str, tuple[str, str]] = {}
        groups = _sd_targets(coordinator, ports)
        for g in groups:
            if g["labels"]["__meta_kubernetes_pod_container_port_name"] == "metrics":
                g["targets"] = [f"127.0.0.1:{http.port}"]
        (tmp_path / "a.json").write_text(json.dumps(groups))
        (tmp_path / "b.json").write_text("[]")
        a = _Prometheus(tmp_path, "a", _with_file_sd(yaml.safe_load((PROM / "prometheus-dc-a.yml").read_text()),
                                                     tmp_path / "a.json"))
        try:
            b_config = _with_file_sd(yaml.safe_load((PROM / "prometheus-dc-b.yml").read_text()), tmp_path / "b.json")
            (federate,) = [j for j in b_config["scrape_configs"] if j.get("metrics_path") == "/federate"]
            assert federate["honor_labels"] and federate["params"]["match[]"] == ['{job="diloco-coordinator"}']
            federate["static_configs"] = [{"targets": [f"127.0.0.1:{a.port}"]}]
            b = _Prometheus(tmp_path, "b", b_config)
            try:
                a.wait("A scrapes the coordinator", lambda: a.api("query", query='up{job="diloco-coordinator"} == 1')["result"])
                seen = b.wait("B sees the coordinator's series", lambda: b.api(
                    "query", query='diloco_coordinator_expected_groups{job="diloco-coordinator"}')["result"])
                assert seen[0]["value"][1] == "2" and seen[0]["metric"]["datacenter"] == "dc-a", seen
                assert b.api("query", query='up{job="diloco-coordinator"}')["result"][0]["value"][1] == "1"
                expiry = b.api("query", query="diloco_coordinator_tls_certificate_expiry_timestamp_seconds - time()")
                days = sorted(float(r["value"][1]) / 86400 for r in expiry["result"])
                assert len(days) == 2 and all(29 < d <= 30 for d in days), days  # transport.certs: 30 days
                rules = b.wait("B's rules evaluated", lambda: [r for g in b.api("rules")["groups"] for r in g["rules"]
                                                                if r.get("lastEvaluation", "").startswith("2")] or None)
                absent = next(r for r in rules if r["name"] == "DilocoCoordinatorAbsent")
                assert absent["health"] == "ok" and absent["state"] == "inactive"
            finally:
                b.close()
        finally:
            a.close()
