"""Pod Security levels per overlay: every pod that can run under ``restricted`` does, and the level
each kustomization needs is the one deploy/README.md tells the operator to label its namespace with.

Kubernetes' Pod Security admission cannot run here, so ``violations`` is a small pure checker of the
Pod Security Standards' ``baseline`` and ``restricted`` rules (as of Kubernetes 1.29,
https://kubernetes.io/docs/concepts/security/pod-security-standards/), tested below on pods that
break each rule. docs/operations.md ("Checks only a real cluster can do") gives the server-side
check to run on a cluster.
"""

from __future__ import annotations

import copy
import re
import subprocess

import pytest
from ops_helpers import DEPLOY, need_binary

KUBERNETES = DEPLOY / "kubernetes"
KUSTOMIZATIONS = sorted(p.parent for folder in ("overlays", "examples")
                        for p in (KUBERNETES / folder).glob("*/kustomization.yaml"))

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
LEVELS = ("restricted", "baseline", "privileged")


def _containers(pod: dict) -> list[dict]:
    return [c for key in ("initContainers", "containers", "ephemeralContainers") for c in pod.get(key, [])]


def violations(pod: dict, level: str, annotations: dict | None = None) -> list[str]:
    """What in a pod spec (``spec.template.spec``) breaks the Pod Security Standard ``level``
    (``baseline`` or ``restricted``, which includes baseline); [] when it passes."""
    assert level in ("baseline", "restricted"), level
    out: list[str] = []
    ctx = pod.get("securityContext") or {}
    containers = _containers(pod)
    cctx = {c["name"]: c.get("securityContext") or {} for c in containers}
    # --- baseline
    for ns in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(ns):
            out.append(f"{ns}: true")
    contexts = [("pod", ctx)] + list(cctx.items())
    for who, sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{who}: windowsOptions.hostProcess")
        if sc.get("privileged"):
            out.append(f"{who}: privileged")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{who}: seccompProfile Unconfined")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{who}: seLinuxOptions {se}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{who}: procMount {sc['procMount']}")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"{who}: appArmorProfile Unconfined")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"{who}: adds capabilities {sorted(added - BASELINE_CAPABILITIES)}")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and \
                not (value == "runtime/default" or value.startswith("localhost/")):
            out.append(f"AppArmor {key}: {value}")
    for volume in pod.get("volumes", []):
        if "hostPath" in volume:
            out.append(f"volume {volume['name']}: hostPath")
    for c in containers:
        for p in c.get("ports", []):
            # with hostNetwork the API server sets hostPort = containerPort on every declared port
            host_port = p.get("hostPort") or (p["containerPort"] if pod.get("hostNetwork") else 0)
            if host_port:
                out.append(f"{c['name']}: hostPort {host_port}")
    for s in ctx.get("sysctls", []):
        if s["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {s['name']} is not a safe one")
    if level == "baseline":
        return out
    # --- restricted
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_seccomp = (ctx.get("seccompProfile") or {}).get("type")
    for c in containers:
        sc, name = cctx[c["name"]], c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot", ctx.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", ctx.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        if (sc.get("seccompProfile") or {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile is neither RuntimeDefault nor Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities beyond NET_BIND_SERVICE")
    if ctx.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    return out


def level_of(pod: dict, annotations: dict | None = None) -> str:
    """The strictest Pod Security level a pod passes."""
    for level in LEVELS[:2]:
        if not violations(pod, level, annotations):
            return level
    return "privileged"


def _documented_levels() -> dict[str, str]:
    """deploy/README.md's table: ``| `kubernetes/overlays/dc-a` | `restricted` | ...``."""
    text = (DEPLOY / "README.md").read_text()
    return dict(re.findall(r"^\| `kubernetes/((?:overlays|examples)/[\w-]+)` \| `(restricted|baseline|privileged)` \|",
                           text, re.M))


@pytest.fixture(scope="module")
def pods() -> dict[str, list[tuple[str, dict, dict]]]:
    """``{kustomization: [(object name, pod spec, pod annotations)]}``."""
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with yamllint (the dev extras)")
    kubectl = need_binary("kubectl", "it ships kustomize: https://kubernetes.io/docs/tasks/tools/")
    out = {}
    for path in KUSTOMIZATIONS:
        text = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60,
                              check=True).stdout
        objects = [d for d in yaml.safe_load_all(text) if d]
        out[str(path.relative_to(KUBERNETES))] = [
            (o["metadata"]["name"], o["spec"]["template"]["spec"], o["spec"]["template"]["metadata"].get("annotations"))
            for o in objects if "template" in o.get("spec", {})]
    return out


def test_each_kustomization_needs_the_pod_security_level_the_readme_gives_and_no_more(pods):
    documented = _documented_levels()
    assert set(documented) == set(pods), f"deploy/README.md's Pod Security table lists {sorted(documented)}"
    for name, specs in pods.items():
        assert specs, name
        needed = max((level_of(spec, ann) for _, spec, ann in specs), key=LEVELS.index)
        assert needed == documented[name], \
            f"{name}: its pods need {needed!r}, deploy/README.md says {documented[name]!r}: " + "; ".join(
                f"{obj}: {violations(spec, 'restricted', ann)}" for obj, spec, ann in specs)


def test_only_host_network_keeps_a_pod_from_restricted(pods):
    """Every pod meets restricted except for what the host network itself implies (hostNetwork and
    the host ports it declares): nothing else is left for a namespace label to allow."""
    for name, specs in pods.items():
        for obj, spec, ann in specs:
            if spec.get("hostNetwork"):
                left = [v for v in violations(spec, "restricted", ann) if not v.startswith("hostNetwork")
                        and ": hostPort " not in v]
                assert not left, f"{name}: {obj}: {left}"
            else:
                assert level_of(spec, ann) == "restricted", f"{name}: {obj}: {violations(spec, 'restricted', ann)}"


def test_the_checker_refuses_what_each_rule_forbids(pods):
    """The checker is only as good as what it catches: each rule, broken in a restricted pod."""
    base = next(spec for specs in pods.values() for _, spec, _ in specs if level_of(spec) == "restricted")
    assert violations(base, "restricted") == []

    def broken(change) -> dict:
        pod = copy.deepcopy(base)
        change(pod, pod["containers"][0].setdefault("securityContext", {}))
        return pod

    not_baseline = {
        "hostNetwork": lambda p, c: p.update(hostNetwork=True),
        "hostPID": lambda p, c: p.update(hostPID=True),
        "privileged": lambda p, c: c.update(privileged=True),
        "SYS_ADMIN": lambda p, c: c.update(capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
        "hostPath": lambda p, c: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "hostPort": lambda p, c: p["containers"][0]["ports"].append({"containerPort": 1, "hostPort": 1}),
        "Unconfined": lambda p, c: c.update(seccompProfile={"type": "Unconfined"}),
        "sysctl": lambda p, c: p["securityContext"].setdefault("sysctls", []).append(
            {"name": "net.core.somaxconn", "value": "1024"}),
        "seLinux": lambda p, c: c.update(seLinuxOptions={"type": "spc_t"}),
        "procMount": lambda p, c: c.update(procMount="Unmasked"),
    }
    for what, change in not_baseline.items():
        assert violations(broken(change), "baseline"), f"baseline lets {what} through"
    # a host-network pod's declared ports become host ports: not baseline even without hostPort
    pod = broken(lambda p, c: p.update(hostNetwork=True))
    assert any("hostPort" in v for v in violations(pod, "baseline"))
    not_restricted = {
        "escalation": lambda p, c: c.pop("allowPrivilegeEscalation"),
        "root": lambda p, c: (p["securityContext"].pop("runAsNonRoot"), c.pop("runAsNonRoot", None)),
        "uid 0": lambda p, c: c.update(runAsUser=0),
        "no seccomp": lambda p, c: (p["securityContext"].pop("seccompProfile"), c.pop("seccompProfile", None)),
        "capabilities kept": lambda p, c: c.update(capabilities={"drop": ["NET_RAW"]}),
        "CHOWN": lambda p, c: c.update(capabilities={"drop": ["ALL"], "add": ["CHOWN"]}),
        "nfs volume": lambda p, c: p["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}}),
    }
    for what, change in not_restricted.items():
        pod = broken(change)
        assert violations(pod, "restricted"), f"restricted lets {what} through"
        assert level_of(pod) == "baseline", f"{what} breaks restricted only"
    safe = broken(lambda p, c: p["securityContext"].update(sysctls=[{"name": "net.ipv4.tcp_syncookies", "value": "1"}]))
    assert violations(safe, "restricted") == [], "a safe sysctl is allowed"
