"""deploy/kubernetes: every overlay renders, validates strictly, and is wired to what the code accepts.

The wiring tests read ``diloco worker --help``, ``diloco coordinator --help`` and ``torchrun --help``
at run time, so a flag renamed in the code fails here until the manifests follow.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import tomllib
from ops_helpers import OVERLAYS

from diloco.job import config as config_mod
from diloco.job import config_parse
from diloco.runtime.connection import SECRET_ENV, TOKEN_ENV


def _help_flags(*command: str) -> set[str]:
    text = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True,
                          timeout=120, check=True).stdout
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9_-]*)", text))


@pytest.fixture(scope="module")
def help_flags() -> dict[str, set[str]]:
    return {
        "worker": _help_flags("-m", "diloco", "worker"),
        "coordinator": _help_flags("-m", "diloco", "coordinator"),
        "torchrun": _help_flags("-m", "torch.distributed.run"),
    }


def _one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _flags(args: list[str]) -> dict[str, str | None]:
    """``--flag=value`` / ``--flag`` -> value (None for a bare switch)."""
    out: dict[str, str | None] = {}
    for a in args:
        if a.startswith("--"):
            name, _, value = a.partition("=")
            out[name] = value if "=" in a else None
    return out


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _worker(objects: list[dict]) -> tuple[dict, dict, list[str], list[str]]:
    """(StatefulSet, its container, torchrun's args, diloco worker's args)."""
    sts = _one(objects, "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    i = args.index("-m")
    assert args[i + 1: i + 3] == ["diloco", "worker"], "the worker must run `torchrun ... -m diloco worker`"
    return sts, container, args[:i], args[i + 3:]


def _job_toml(objects: list[dict], container: dict, spec: dict) -> dict:
    """The TOML the worker's --config points at, read from the rendered ConfigMap it mounts."""
    path = _flags(_worker_args(container))["--config"]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    cm = _one(objects, "ConfigMap", volume["configMap"]["name"])
    return tomllib.loads(cm["data"][path[len(mount["mountPath"]):].lstrip("/")])


def _worker_args(container: dict) -> list[str]:
    args = container["args"]
    return args[args.index("-m") + 3:]


def test_every_overlay_renders_a_group_and_one_hosts_the_coordinator(rendered):
    assert len(rendered) >= 2, f"need an overlay per datacenter, found {list(rendered)}"
    with_coordinator = []
    for name, objects in rendered.items():
        kinds = {o["kind"] for o in objects}
        assert {"StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"} <= kinds, name
        sts = _one(objects, "StatefulSet")
        service = _one(objects, "Service", sts["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        for kind in ("NetworkPolicy", "PodDisruptionBudget"):
            selectors = [o["spec"].get("podSelector", o["spec"].get("selector"))["matchLabels"]
                         for o in objects if o["kind"] == kind]
            assert any(s.items() <= labels.items() for s in selectors), f"{name}: no {kind} selects the workers"
        if any(o["kind"] == "Deployment" for o in objects):
            with_coordinator.append(name)
    assert len(with_coordinator) == 1, f"exactly one datacenter hosts the coordinator: {with_coordinator}"


def test_rendered_objects_validate_strictly_against_current_kubernetes(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the dev extras)")
    version = kv.latest_version()
    for objects in rendered.values():
        for obj in objects:  # a custom resource would raise SchemaNotFoundError: there is none
            kv.validate(obj, version, strict=True)
    # the validation is strict: an unknown field in a pod template is refused
    broken = copy.deepcopy(_one(next(iter(rendered.values())), "StatefulSet"))
    broken["spec"]["template"]["spec"]["containers"][0]["cpuCount"] = 2
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, version, strict=True)


def test_overlays_differ_in_nic_count_and_link_settings(rendered):
    nics, links = {}, {}
    for name, objects in rendered.items():
        sts, container, _, worker_args = _worker(objects)
        nics[name] = sts["spec"]["replicas"] * int(_env(container)["DILOCO_RANKS_PER_NODE"]["value"])
        links[name] = {k: v for k, v in _flags(worker_args).items() if k in ("--connections", "--timeout")}
    assert len(set(nics.values())) > 1, f"overlays should differ in NIC (rank) count: {nics}"
    assert len({tuple(sorted(v.items())) for v in links.values()}) > 1, f"and in link settings: {links}"


def test_worker_command_line_matches_what_torchrun_and_diloco_worker_accept(rendered, help_flags):
    for name, objects in rendered.items():
        sts, container, torchrun_args, worker_args = _worker(objects)
        assert container["command"] == ["torchrun"]
        unknown = set(_flags(torchrun_args)) - help_flags["torchrun"]
        assert not unknown, f"{name}: torchrun does not accept {unknown}"
        unknown = set(_flags(worker_args)) - help_flags["worker"]
        assert not unknown, f"{name}: diloco worker does not accept {unknown}"
        env = _env(container)
        for ref in re.findall(r"\$\((\w+)\)", " ".join(container["args"])):
            assert ref in env, f"{name}: $({ref}) in the args is not defined in the container's env"
        t = _flags(torchrun_args)
        assert env["DILOCO_NODES"]["value"] == str(sts["spec"]["replicas"]), \
            f"{name}: torchrun --nnodes must equal the StatefulSet's replicas"
        assert t["--master-addr"] == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}", \
            f"{name}: the rendezvous must be rank 0's stable DNS name"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(t["--master-port"]) == ports["rendezvous"]
        assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['apps.kubernetes.io/pod-index']" and t["--node-rank"] == "$(POD_INDEX)"
        w = _flags(worker_args)
        assert w["--host"] == "$(POD_IP)" and env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert int(w["--metrics-port"]) == ports["metrics"]
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == ports["metrics"]
        assert w["--log-format"] in config_mod.LOG_FORMATS


def test_coordinator_command_line_matches_diloco_coordinator_and_the_job(rendered, help_flags):
    (objects,) = [o for o in rendered.values() if any(x["kind"] == "Deployment" for x in o)]
    deployment = _one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "coordinator"
    flags = _flags(container["args"][1:])
    unknown = set(flags) - help_flags["coordinator"]
    assert not unknown, f"diloco coordinator does not accept {unknown}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(flags["--port"]) == ports["grpc"] and int(flags["--metrics-port"]) == ports["metrics"]
    assert container["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" and "readinessProbe" in container
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    service = _one(objects, "Service", "diloco-coordinator")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    for name, group_objects in rendered.items():  # every group dials a coordinator port that exists
        _, worker_container, _, _ = _worker(group_objects)
        address = _env(worker_container)["DILOCO_COORDINATOR"]["value"]
        assert address.rsplit(":", 1)[1] == flags["--port"], f"{name} dials {address}"
        job = _job_toml(group_objects, worker_container, _one(group_objects, "StatefulSet")["spec"]["template"]["spec"])
        assert job["topology"]["groups"] == int(flags["--groups"]), f"{name}: groups differ from the coordinator's"


def test_job_config_loads_and_every_group_matches_its_size(rendered):
    group_ids = []
    for name, objects in rendered.items():
        sts, container, _, worker_args = _worker(objects)
        job = _job_toml(objects, container, sts["spec"]["template"]["spec"])
        cfg = config_parse.from_dict(job).validate()
        env = _env(container)
        group = int(env["DILOCO_GROUP_ID"]["value"])
        group_ids.append(group)
        ranks = sts["spec"]["replicas"] * int(env["DILOCO_RANKS_PER_NODE"]["value"])
        assert cfg.topology.sizes()[group] == ranks, \
            f"{name}: group {group} has {ranks} ranks but the job config gives {cfg.topology.sizes()[group]}"
    assert sorted(group_ids) == list(range(len(group_ids))), f"each overlay must be another group: {group_ids}"
    tomls = {name: _job_toml(o, _worker(o)[1], _one(o, "StatefulSet")["spec"]["template"]["spec"])
             for name, o in rendered.items()}
    assert len({repr(sorted(t.items())) for t in tomls.values()}) == 1, "every group must get the same job config"


def test_secrets_and_certificates_come_only_from_secrets(rendered):
    for name, objects in rendered.items():
        for obj in objects:
            assert obj["kind"] != "Secret", f"{name}: a Secret in the manifests would put its value in git"
            spec = obj.get("spec", {}).get("template", {}).get("spec")
            if spec is None:
                continue
            (container,) = spec["containers"]
            env = _env(container)
            for var in (SECRET_ENV, TOKEN_ENV):
                if var in env:
                    assert "secretKeyRef" in env[var].get("valueFrom", {}), f"{name}: {var} must come from a Secret"
            text = " ".join(container.get("args", []) + container.get("command", [])).lower()
            assert "secret" not in text and "token" not in text, f"{name}: credentials in the command line"
            tls_args = {k: v for k, v in _flags(container.get("args", [])).items() if k.startswith("--tls-")}
            for flag, path in tls_args.items():
                mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
                volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
                assert "secret" in volume, f"{name}: {flag} must be read from a Secret volume"
            # the data plane, and a coordinator on a non-loopback host, serve mutual TLS
            assert set(tls_args) == {"--tls-cert", "--tls-key", "--tls-ca"}, f"{name}: {obj['kind']} needs mTLS"
            assert "--insecure-coordinator" not in container.get("args", [])


def test_pods_are_bounded_and_unprivileged(rendered):
    for name, objects in rendered.items():
        for obj in objects:
            spec = obj.get("spec", {}).get("template", {}).get("spec")
            if spec is None:
                continue
            assert spec["securityContext"]["runAsNonRoot"] and spec["automountServiceAccountToken"] is False
            for c in spec["containers"]:
                assert set(c["resources"]["requests"]) >= {"cpu", "memory"} <= set(c["resources"]["limits"]), \
                    f"{name}: {c['name']} needs requests and limits"
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
                assert ":" in c["image"] and not c["image"].endswith(":latest")


def test_network_policies_admit_only_the_data_plane_rendezvous_coordinator_and_metrics_ports(rendered):
    for name, objects in rendered.items():
        sts, container, _, _ = _worker(objects)
        pod = sts["spec"]["template"]["spec"]
        policy = _one(objects, "NetworkPolicy", "diloco-worker")
        ports = {(p["port"], p.get("endPort")) for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        named = {p["containerPort"] for p in container["ports"]}
        sysctls = {s["name"]: s["value"] for s in pod.get("securityContext", {}).get("sysctls", [])}
        if pod.get("hostNetwork"):
            assert not sysctls, f"{name}: a host-network pod may not set namespaced sysctls"
        else:
            low, high = map(int, sysctls["net.ipv4.ip_local_port_range"].split())
            assert (low, high) in ports, f"{name}: the data-plane port range {low}-{high} is not admitted"
        assert {p for p, end in ports if end is None} <= named, f"{name}: {ports} admits a port nothing listens on"
        if any(o["kind"] == "Deployment" for o in objects):
            coordinator = _one(objects, "NetworkPolicy", "diloco-coordinator")
            deployment = _one(objects, "Deployment")
            cports = {p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
            admitted = {p["port"] for rule in coordinator["spec"]["ingress"] for p in rule["ports"]}
            assert admitted == cports


def test_overlays_are_listed_for_the_docs():
    readme = (OVERLAYS[0].parents[2] / "README.md").read_text()
    for overlay in OVERLAYS:
        assert f"overlays/{overlay.name}" in readme, f"deploy/README.md does not describe {overlay.name}"
