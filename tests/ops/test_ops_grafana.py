"""deploy/grafana: the committed dashboard is the generator's output and queries only exported series;
the rules and the example scrape configuration name only exported series and the jobs the manifests give."""

from __future__ import annotations

import importlib.util
import json
import re

import yaml
from ops_helpers import DEPLOY

from diloco.coordinator.metrics import COORDINATOR_SERIES
from diloco.runtime.ops.metrics import WORKER_SERIES

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


RULE_FILES = sorted(p for p in (DEPLOY / "prometheus").glob("diloco-*.yml") if not p.name.endswith(".test.yml"))


def test_rules_name_only_exported_series():
    exprs, alerts = [], set()
    for path in RULE_FILES:
        rules = yaml.safe_load(path.read_text())
        exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
        alerts |= {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    used = set().union(*map(_names, exprs))
    assert used <= EXPORTED, f"not exported: {used - EXPORTED}"
    assert {"DilocoGroupDown", "DilocoRoundStalled", "DilocoLowComputeUtilization", "DilocoCoordinatorAbsent",
            "DilocoGroupAbsent", "DilocoCertificateExpiresSoon"} <= alerts


def test_scrape_configs_give_the_jobs_the_rules_use_and_each_group_has_an_absent_alert(rendered):
    components, groups = set(), {}
    for name, objects in rendered.items():
        for o in objects:
            if o["kind"] in ("Job", "StatefulSet", "Deployment"):
                labels = o["spec"]["template"]["metadata"]["labels"]
                components.add(labels["app.kubernetes.io/component"])
                if labels["app.kubernetes.io/component"] == "worker":
                    assert "diloco.dev/group" in labels, f"{name}: worker pods need a group label"
                    groups[labels["diloco.dev/group"]] = name
    rules_text = "".join(p.read_text() for p in RULE_FILES)
    assert {f"diloco-{c}" for c in components} == set(re.findall(r'job="(diloco-[a-z]+)"', rules_text))
    for dc in rendered:
        config = yaml.safe_load((DEPLOY / "prometheus" / f"prometheus-{dc}.yml").read_text())
        (job,) = [j for j in config["scrape_configs"] if "kubernetes_sd_configs" in j]
        relabel = {r.get("target_label"): r for r in job["relabel_configs"]}
        assert relabel["job"]["replacement"] == "diloco-$1"
        assert relabel["job"]["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
        assert relabel["group"]["source_labels"] == ["__meta_kubernetes_pod_label_diloco_dev_group"]
        assert config["global"]["external_labels"]["datacenter"] == dc
        absent = "".join((DEPLOY / "prometheus" / f).read_text() for f in config["rule_files"])
        for group, where in groups.items():
            rule = f'absent(up{{job="diloco-worker", group="{group}"}})'
            assert (rule in absent) == (where == dc), f"{dc}'s Prometheus and group {group}'s absent() alert"
