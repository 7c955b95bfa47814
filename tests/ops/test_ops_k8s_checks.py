"""What the manifest replay cannot check, checked offline against every kustomization that ships
(the overlays and the examples): the Kubernetes version they need, strict schema validation at that
version and the newest one known, ports outside the NodePort range, internal load balancers that
keep the clients' addresses on each cloud, checkpoint storage writable by the pods' user, and a
changed config or image that cannot slip into a running Job. What only a real cluster can tell is
listed, with the commands to run there, in docs/operations.md ("Checks only a real cluster can do").
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from ops_helpers import DEPLOY, ROOT, need_binary

KUBERNETES = DEPLOY / "kubernetes"
# every kustomization a user may apply: one folder per datacenter, and the examples
KUSTOMIZATIONS = sorted(p.parent for folder in ("overlays", "examples")
                        for p in (KUBERNETES / folder).glob("*/kustomization.yaml"))
NODE_PORTS = (30000, 32767)  # the API server's default --service-node-port-range


def _render(path: Path) -> list[dict]:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with yamllint (the dev extras)")
    kubectl = need_binary("kubectl", "it ships kustomize: https://kubernetes.io/docs/tasks/tools/")
    text = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60,
                          check=True).stdout
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def every() -> dict[str, list[dict]]:
    """``{kustomization (relative to deploy/kubernetes): [objects]}`` for every overlay and example."""
    assert len(KUSTOMIZATIONS) >= 4, KUSTOMIZATIONS
    return {str(p.relative_to(KUBERNETES)): _render(p) for p in KUSTOMIZATIONS}


def _kv():
    return pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the dev extras)")


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


# --- the Kubernetes version ----------------------------------------------------------------------

def _stated_minimum() -> str:
    """The minimum version the docs state ("Kubernetes ≥ 1.29"), the same in every place."""
    stated = {}
    for doc in (DEPLOY / "README.md", ROOT / "docs" / "operations.md"):
        found = set(re.findall(r"Kubernetes ≥ (1\.\d+)", doc.read_text()))
        assert len(found) == 1, f"{doc} should state one minimum Kubernetes version (\"Kubernetes ≥ 1.N\"): {found}"
        stated[doc.name] = found.pop()
    assert len(set(stated.values())) == 1, f"the docs state different minimum versions: {stated}"
    return next(iter(stated.values()))


# pod labels the Job controller sets, which the manifests select on or read through the downward API:
# the release whose Job controller sets them by default
CONTROLLER_LABELS = {"batch.kubernetes.io/job-name": "1.27", "batch.kubernetes.io/job-completion-index": "1.28"}
_NOT_ON_BY_DEFAULT = re.compile(r"This field is alpha-level|This is an alpha field", re.I)


def _schema_dir(version: str) -> Path:
    import kubernetes_validate

    return Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local-strict"


def _fields_unavailable(objects: list[dict], version: str) -> list[str]:
    """The fields of ``objects`` that ``version``'s API does not have, or has only behind an alpha
    feature gate (off by default), as its own OpenAPI descriptions say."""
    folder = _schema_dir(version)
    defs = json.loads((folder / "_definitions.json").read_text())["$defs"]
    out: list[str] = []

    def walk(schema: dict, value, path: str) -> None:
        while "$ref" in schema:
            schema = defs[schema["$ref"].rsplit("/", 1)[1]]
        if isinstance(value, dict) and "properties" in schema:
            for key, item in value.items():
                prop = schema["properties"].get(key)
                if prop is None:
                    out.append(f"{path}.{key} (absent)")
                    continue
                if _NOT_ON_BY_DEFAULT.search(prop.get("description", "")):
                    out.append(f"{path}.{key} (alpha)")
                walk(prop, item, f"{path}.{key}")
        elif isinstance(value, list) and "items" in schema:
            for item in value:
                walk(schema["items"], item, f"{path}[]")

    for obj in objects:
        group, _, api = obj["apiVersion"].rpartition("/")
        name = "-".join(x for x in (obj["kind"].lower(), group.split(".")[0], api) if x)
        walk(json.loads((folder / f"{name}.json").read_text()), obj, obj["kind"])
    return out


def _controller_labels_used(objects: list[dict]) -> set[str]:
    """The batch.kubernetes.io/ pod labels the objects select on or read (downward API)."""
    found: set[str] = set()

    def walk(value, key: str = "") -> None:
        if isinstance(value, dict):
            if key in ("selector", "matchLabels") and all(isinstance(v, str) for v in value.values()):
                found.update(k for k in value if k.startswith("batch.kubernetes.io/"))
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, list):
            for v in value:
                walk(v, key)
        elif key == "fieldPath" and isinstance(value, str):
            found.update(re.findall(r"metadata\.labels\['(batch\.kubernetes\.io/[\w.-]+)'\]", value))

    walk(objects)
    return found


def test_the_stated_minimum_version_is_the_oldest_that_has_every_field_on_by_default(every):
    """The floor is derived, not asserted: the oldest release whose API has every field the
    manifests use, none of them behind an alpha (off by default) feature gate, and whose Job
    controller sets the pod labels they use. Using a newer field (say, successPolicy) without
    raising the stated minimum fails here."""
    kv = _kv()
    minimum = _stated_minimum()
    bundled = [v for v in kv.utils.all_versions() if _schema_dir(v).is_dir()]
    floor = None
    for version in bundled:
        missing = [f for objects in every.values() for f in _fields_unavailable(objects, version)]
        labels = {label for objects in every.values() for label in _controller_labels_used(objects)}
        unknown = labels - set(CONTROLLER_LABELS)
        assert not unknown, f"which release's Job controller sets {unknown}? add it to CONTROLLER_LABELS"
        missing += [label for label in labels if _version(CONTROLLER_LABELS[label]) > _version(version)]
        if not missing:
            floor = version
            break
        previous = (version, sorted(set(missing)))
    assert floor is not None, "no bundled Kubernetes version has every field the manifests use"
    assert bundled.index(floor) > 0, "the oldest bundled schema already has everything: the floor may be lower"
    assert _version(floor) == _version(minimum), \
        f"the docs state Kubernetes ≥ {minimum}, the manifests need {floor} ({previous[0]} lacks {previous[1]})"


def test_every_kustomization_validates_strictly_at_the_minimum_and_the_newest_version(every):
    kv = _kv()
    minimum = next(v for v in kv.utils.all_versions() if _version(v) == _version(_stated_minimum()))
    for version in (minimum, kv.latest_version()):
        for name, objects in every.items():
            for obj in objects:  # a custom resource would raise SchemaNotFoundError: there is none
                try:
                    kv.validate(obj, version, strict=True)
                except kv.ValidationError as e:
                    pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']} against {version}: {e.message} "
                                f"at {'.'.join(map(str, e.absolute_path))}")
    # strict: a missing required field and an unknown one are refused
    job = copy.deepcopy(next(o for o in every["overlays/dc-a"] if o["kind"] == "Job"))
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        for condition in rule.get("onPodConditions", []):
            del condition["status"]
    with pytest.raises(kv.ValidationError):
        kv.validate(job, minimum, strict=True)
    job = copy.deepcopy(next(o for o in every["overlays/dc-a"] if o["kind"] == "Job"))
    job["spec"]["template"]["spec"]["containers"][0]["cpuCount"] = 2
    with pytest.raises(kv.ValidationError):
        kv.validate(job, kv.latest_version(), strict=True)


# --- ports -------------------------------------------------------------------------------------------

def _port_ranges(objects: list[dict]):
    """(where, low, high) of every port and port range the objects name or make the kernel use."""
    for obj in objects:
        kind, name, spec = obj["kind"], obj["metadata"]["name"], obj.get("spec", {})
        pod = spec.get("template", {}).get("spec")
        if pod is not None:
            for s in pod.get("securityContext", {}).get("sysctls", []):
                if s["name"] == "net.ipv4.ip_local_port_range":
                    low, high = map(int, s["value"].split())
                    yield f"{kind} {name}: sysctl {s['name']}", low, high
            for c in pod.get("containers", []):
                for p in c.get("ports", []):
                    yield f"{kind} {name}: containerPort {p.get('name')}", p["containerPort"], p["containerPort"]
                    if p.get("hostPort"):
                        yield f"{kind} {name}: hostPort", p["hostPort"], p["hostPort"]
        if kind == "Service":
            for p in spec.get("ports", []):
                for field in ("port", "targetPort", "nodePort"):
                    if isinstance(p.get(field), int):
                        yield f"Service {name}: {field}", p[field], p[field]
        if kind == "NetworkPolicy":
            for rule in spec.get("ingress", []) + spec.get("egress", []):
                for p in rule.get("ports", []):
                    if isinstance(p.get("port"), int):
                        yield f"NetworkPolicy {name}", p["port"], p.get("endPort", p["port"])


def _node_file_port_ranges():
    """(where, low, high) from the node files the overlays ship (nftables rules, sysctl.d)."""
    for path in sorted(KUBERNETES.glob("overlays/*/*.nft")):
        for low, high in re.findall(r"\b(\d{4,5})(?:-(\d{4,5}))?\b", " ".join(
                line for line in path.read_text().splitlines() if "dport" in line)):
            yield str(path.relative_to(KUBERNETES)), int(low), int(high or low)
    for path in sorted(KUBERNETES.glob("overlays/*/*sysctl*")):
        for low, high in re.findall(r"ip_local_port_range\s*=\s*(\d+)\s+(\d+)", path.read_text()):
            yield str(path.relative_to(KUBERNETES)) + ": ip_local_port_range", int(low), int(high)


def test_no_port_or_port_range_overlaps_the_node_port_range(every):
    """NodePorts (30000-32767 by default) are opened by kube-proxy on every node: a data, Gloo or
    ephemeral port there would collide with a Service's NodePort (a LoadBalancer Service gets one
    too), on host-network nodes for certain."""
    found = [(name, *r) for name, objects in every.items() for r in _port_ranges(objects)]
    found += [("node files", *r) for r in _node_file_port_ranges()]
    # the check sees the ranges that matter: the pods' and the nodes' ephemeral ranges, the policies' ranges
    assert any("ip_local_port_range" in where for _, where, _, _ in found)
    assert any(where.endswith("node-sysctl.conf: ip_local_port_range") for _, where, _, _ in found)
    assert any(where.startswith("NetworkPolicy") and high > low for _, where, low, high in found)
    overlapping = [f"{name}: {where} {low}-{high}" for name, where, low, high in found
                   if low <= NODE_PORTS[1] and high >= NODE_PORTS[0]]
    assert not overlapping, f"inside the NodePort range {NODE_PORTS}: {overlapping}"


# --- load balancers ----------------------------------------------------------------------------------

# what each cloud's component must set: an internal balancer that passes the clients' addresses on
CLOUDS = {
    "aws": {"service.beta.kubernetes.io/aws-load-balancer-type": "external",
            "service.beta.kubernetes.io/aws-load-balancer-nlb-target-type": "ip",
            "service.beta.kubernetes.io/aws-load-balancer-scheme": "internal",
            "service.beta.kubernetes.io/aws-load-balancer-target-group-attributes":
                "preserve_client_ip.enabled=true"},
    "azure": {"service.beta.kubernetes.io/azure-load-balancer-internal": "true"},
    "gcp": {"networking.gke.io/load-balancer-type": "Internal"},
}
CLOUD_PREFIXES = ("service.beta.kubernetes.io/", "networking.gke.io/", "cloud.google.com/")


def _cloud_of(service: dict) -> list[str]:
    annotations = service["metadata"].get("annotations", {})
    return [cloud for cloud, wanted in CLOUDS.items() if wanted.items() <= annotations.items()]


def test_every_load_balancer_is_internal_on_one_cloud_and_keeps_the_clients_addresses(every):
    balancers = 0
    for name, objects in every.items():
        for svc in (o for o in objects if o["kind"] == "Service" and o["spec"].get("type") == "LoadBalancer"):
            balancers += 1
            what = f"{name}: Service {svc['metadata']['name']}"
            assert svc["metadata"]["labels"].get("diloco.dev/load-balancer") == "internal", \
                f"{what}: not labelled, so no cloud component annotates it"
            assert len(_cloud_of(svc)) == 1, f"{what}: one cloud's internal balancer, not {_cloud_of(svc)}"
            annotations = svc["metadata"]["annotations"]
            assert "service.beta.kubernetes.io/aws-load-balancer-internal" not in annotations, \
                f"{what}: a Classic ELB proxies and hides the client's address"
            assert svc["spec"]["externalTrafficPolicy"] == "Local", f"{what}: no SNAT through another node"
            assert svc["spec"]["loadBalancerSourceRanges"], f"{what}: open to anyone who reaches the balancer"
    assert balancers >= 3, "the coordinator's and the per-rank balancers"


def test_each_cloud_component_annotates_every_internal_load_balancer_and_nothing_else(tmp_path):
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with yamllint (the dev extras)")
    components = KUBERNETES / "components" / "load-balancer"
    assert sorted(p.parent.name for p in components.glob("*/kustomization.yaml")) == sorted(CLOUDS)
    services = [{"apiVersion": "v1", "kind": "Service",
                 "metadata": {"name": name, "labels": labels},
                 "spec": {"type": kind, "selector": {"app": "x"}, "ports": [{"port": 29400}]}}
                for name, labels, kind in (("balancer", {"diloco.dev/load-balancer": "internal"}, "LoadBalancer"),
                                           ("inside", {}, "ClusterIP"))]
    for cloud in CLOUDS:
        folder = tmp_path / cloud
        folder.mkdir()
        (folder / "services.yaml").write_text(yaml.safe_dump_all(services))
        (folder / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": ["services.yaml"], "components": [os.path.relpath(components / cloud, folder)]}))
        rendered = {o["metadata"]["name"]: o for o in _render(folder)}
        assert _cloud_of(rendered["balancer"]) == [cloud], f"{cloud}: {rendered['balancer']['metadata']}"
        assert not any(k.startswith(CLOUD_PREFIXES) for k in rendered["inside"]["metadata"].get("annotations", {}))
        _kv().validate(rendered["balancer"], _kv().latest_version(), strict=True)


# --- checkpoint storage ------------------------------------------------------------------------------

def _worker_pod(objects: list[dict]) -> dict:
    (job,) = [o for o in objects if o["kind"] == "Job"
              and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
    return job


def test_checkpoint_claims_name_a_class_whose_examples_give_the_pods_user_a_writable_volume(every):
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with yamllint (the dev extras)")
    folder = KUBERNETES / "examples" / "storage"
    examples = {p.name: yaml.safe_load(p.read_text()) for p in sorted(folder.glob("*.yaml"))}
    assert len(examples) >= 3, "examples for EFS, Azure Files and Filestore"
    for name, objects in every.items():
        job = _worker_pod(objects)
        pod = job["spec"]["template"]["spec"]
        ctx = pod["securityContext"]
        assert ctx.get("fsGroupChangePolicy") == "OnRootMismatch", \
            f"{name}: without it the kubelet walks the whole checkpoint volume at every pod start"
        claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
        for claim in claims:
            cls = claim["spec"].get("storageClassName")
            assert cls, f"{name}: {claim['metadata']['name']} takes the default class (no ReadWriteMany on big clouds)"
            if job["spec"]["completions"] > 1:
                assert claim["spec"]["accessModes"] == ["ReadWriteMany"], f"{name}: the group's nodes share it"
            for file, sc in examples.items():
                assert sc["metadata"]["name"] == cls, f"{file} names {sc['metadata']['name']}, the claims {cls}"
                for version in (_stated_minimum(), _kv().latest_version()):
                    _kv().validate(sc, version, strict=True)
                uid, gid = str(ctx["runAsUser"]), str(ctx["runAsGroup"])
                params, options = sc.get("parameters", {}), sc.get("mountOptions", [])
                owned = (params.get("uid") == uid and params.get("gid") == gid) or \
                    {f"uid={uid}", f"gid={gid}"} <= set(options)
                if not owned:  # then the kubelet must apply fsGroup: the doc says how to check the driver
                    assert str(ctx["fsGroup"]) == gid and "fsGroupPolicy: File" in (folder / file).read_text(), \
                        f"{file}: who makes it writable for {uid}?"


# --- a changed config or image -----------------------------------------------------------------------

def test_a_changed_config_or_image_changes_the_jobs_template_so_it_never_reaches_a_running_job(tmp_path):
    """A Job's pod template is immutable: `kubectl apply` of a changed template is refused, never
    half applied. The config reaches the pods through a ConfigMap named after its content
    (diloco-job-<hash>, immutable), so a changed job.toml changes every Job's template, and the old
    ConfigMap, which running pods mount, stays as it was."""
    copy_root = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy_root)
    overlay = copy_root / "overlays" / "dc-a"

    def jobs_and_configs():
        objects = _render(overlay)
        return ({o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] == "Job"},
                {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"})

    jobs, configs = jobs_and_configs()
    assert all(c.get("immutable") is True for c in configs.values()), "a ConfigMap edited in place reaches running pods"
    toml = copy_root / "base" / "job.toml"
    toml.write_text(toml.read_text().replace("h = 100", "h = 200"))
    new_jobs, new_configs = jobs_and_configs()
    assert not set(configs) & set(new_configs), "a changed job.toml must be a ConfigMap of another name"
    workers = [n for n in jobs if "group" in n]
    assert workers and all(new_jobs[n] != jobs[n] for n in workers), "every group's template must change with it"
    kustomization = overlay / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace("newTag: 0.1.0-cpu", "newTag: 0.1.1-cpu"))
    newer_jobs, _ = jobs_and_configs()
    assert all(newer_jobs[n] != new_jobs[n] for n in jobs), "a new image tag changes every template"
