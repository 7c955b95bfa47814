"""deploy/grafana: the committed dashboard is the generator's output and queries only exported series;
the rules and the example scrape configuration name only exported series and the jobs the manifests give."""

from __future__ import annotations

import importlib.util
import json
import re

import yaml
from ops_helpers import DEPLOY

from diloco.coordinator.metrics import COORDINATOR_SERIES
from diloco.runtime.metrics import WORKER_SERIES

EXPORTED = set(WORKER_SERIES) | set(COORDINATOR_SERIES)
RECORDED_PREFIX = "group:"  # recording rules' outputs (level:metric:operations)


def _generator():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", DEPLOY / "grafana" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _names(expr: str) -> set[str]:
    return set(re.findall(r"(?<![\w:])(diloco_[a-z0-9_]+)", expr))


def test_committed_dashboard_is_the_generators_output():
    assert (DEPLOY / "grafana" / "diloco.json").read_text() == _generator().render(), \
        "run python deploy/grafana/dashboard.py"


def test_dashboard_queries_only_exported_series_with_group_and_link_panels():
    dashboard = json.loads((DEPLOY / "grafana" / "diloco.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set().union(*map(_names, exprs))
    assert used and used <= EXPORTED, f"not exported: {used - EXPORTED}"
    assert len(used) >= 25, f"the dashboard shows only {len(used)} series"
    legends = [t["legendFormat"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert any("{{group}}" in legend for legend in legends), "per-group panels"
    assert any("{{peer_group}}" in legend for legend in legends), "per-link panels"
    assert any("{{rank}}" in legend for legend in legends), "per-rank (NIC) panels"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_rules_name_only_exported_series():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "diloco-rules.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = set().union(*map(_names, exprs))
    assert used <= EXPORTED, f"not exported: {used - EXPORTED}"
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert {"DilocoGroupDown", "DilocoRoundStalled", "DilocoLowComputeUtilization"} <= alerts


def test_example_scrape_config_gives_the_jobs_the_rules_use(rendered):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    relabel = {r.get("target_label"): r for r in job["relabel_configs"]}
    assert relabel["job"]["replacement"] == "diloco-$1"
    assert relabel["job"]["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    assert relabel["group"]["source_labels"] == ["__meta_kubernetes_pod_label_diloco_dev_group"]
    components = {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                  for objects in rendered.values() for o in objects if o["kind"] in ("StatefulSet", "Deployment")}
    rules_text = (DEPLOY / "prometheus" / "diloco-rules.yml").read_text()
    assert {f"diloco-{c}" for c in components} == set(re.findall(r'job="(diloco-[a-z]+)"', rules_text))
    for objects in rendered.values():
        sts = next(o for o in objects if o["kind"] == "StatefulSet")
        assert "diloco.dev/group" in sts["spec"]["template"]["metadata"]["labels"]
