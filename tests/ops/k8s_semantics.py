"""What rendered Kubernetes objects and a Dockerfile mean, as pure functions (for ``k8s_replay``):
a Dockerfile target's ENTRYPOINT/CMD/ENV/WORKDIR/USER, ``$(VAR)`` expansion, quantities, label
selectors, a Job's podFailurePolicy, the eviction API's PodDisruptionBudget check, and the
nftables rules of the Ingress NetworkPolicies selecting a pod."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable


class ReplayError(RuntimeError):
    """The manifests ask for something the replay cannot do, or a pod cannot be started."""



# --- the image -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Image:
    """What a Dockerfile target gives a container: ENTRYPOINT, CMD, ENV, WORKDIR, USER."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str
    user: str


def read_image(dockerfile: Path, target: str) -> Image:
    """The target stage's settings, following its FROM chain through earlier stages."""
    stages: dict[str, tuple[str, list[str]]] = {}
    order: list[str] = []
    current = None
    for raw in _logical_lines(dockerfile.read_text()):
        word, _, rest = raw.partition(" ")
        if word.upper() == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else f"#{len(order)}"
            stages[name] = (parts[0], [])
            order.append(name)
            current = name
        elif current is not None:
            stages[current][1].append(raw)
    if target not in stages:
        raise ReplayError(f"{dockerfile}: no stage {target!r} (stages: {order})")
    chain, name = [], target
    while name in stages:
        chain.append(name)
        name = stages[name][0]
    image = Image([], [], {}, "/", "root")
    for name in reversed(chain):
        for line in stages[name][1]:
            word, _, rest = line.partition(" ")
            word = word.upper()
            if word == "ENV":
                for key, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S+)', rest):
                    value = value.strip('"')
                    image.env[key] = re.sub(r"\$(\w+)|\$\{(\w+)\}",
                                            lambda m: image.env.get(m.group(1) or m.group(2), ""), value)
            elif word == "WORKDIR":
                image.workdir = rest.strip()
            elif word == "USER":
                image.user = rest.strip()
            elif word in ("ENTRYPOINT", "CMD"):
                value = json.loads(rest) if rest.strip().startswith("[") else ["/bin/sh", "-c", rest.strip()]
                if word == "ENTRYPOINT":
                    image.entrypoint, image.cmd = value, []
                else:
                    image.cmd = value
    return image


def _logical_lines(text: str) -> list[str]:
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((buf + line).strip())
        buf = ""
    return out


# --- Kubernetes semantics ------------------------------------------------------------------------

def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ escapes, others stay."""
    def sub(m: re.Match) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        name = m.group(1)
        return env[name] if name in env else m.group(0)
    return re.sub(r"\$\$\(?|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (\"250m\", \"4\", \"8Gi\") as a number."""
    s = str(text)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
                "Ti": 2**40}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * suffixes[suffix]
    return float(s)


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) against labels;
    an empty selector selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def failure_action(job: dict, container: str, exit_code: int, disrupted: bool) -> str:
    """What a Job does with a failed pod: its podFailurePolicy's first matching rule's action
    (FailJob, Ignore, Count, FailIndex), Count when none matches or there is no policy."""
    for rule in (job["spec"].get("podFailurePolicy") or {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes is not None:
            if codes.get("containerName") not in (None, container):
                continue
            inside = exit_code in codes["values"]
            if exit_code != 0 and (inside if codes["operator"] == "In" else not inside):
                return rule["action"]
        for condition in rule.get("onPodConditions") or []:
            if condition["type"] == "DisruptionTarget" and disrupted and condition.get("status", "True") == "True":
                return rule["action"]
    return "Count"


def may_evict(pod_labels: dict[str, str], pod_phase: str, budgets: list[dict], healthy: list[dict]) -> tuple[bool, str]:
    """Whether the eviction API lets a drain evict a pod: terminal pods always; otherwise every
    PodDisruptionBudget selecting it must allow one more disruption (an unhealthy pod passes a
    budget with ``unhealthyPodEvictionPolicy: AlwaysAllow``). ``healthy``: the labels of the
    namespace's running pods."""
    if pod_phase in ("Succeeded", "Failed"):
        return True, "terminal"
    for pdb in budgets:
        spec = pdb["spec"]
        if not selects(spec.get("selector"), pod_labels):
            continue
        if (pod_phase != "Running" or pod_labels not in healthy) and spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow":
            continue
        matched = [p for p in healthy if selects(spec.get("selector"), p)]
        allowed = int(spec["maxUnavailable"]) if "maxUnavailable" in spec else len(matched) - int(spec["minAvailable"])
        if allowed < 1:
            return False, f"PodDisruptionBudget {pdb['metadata']['name']} allows no disruption"
    return True, "allowed"


def policy_ruleset(pod: Any, policies: list[dict], peers: Callable[[dict | None, dict | None], list[str]]) -> str:
    """The nftables table that enforces the Ingress NetworkPolicies selecting ``pod`` (a
    ``k8s_replay.Pod``: its labels, ip and spec), in its own
    namespace (nothing when none selects it). ``peers(podSelector, namespaceSelector)``: the
    addresses of the pods they select."""
    mine = [p for p in policies if selects(p["spec"].get("podSelector"), pod.labels)
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    lines = ["table inet replay-policy", "delete table inet replay-policy", "table inet replay-policy {",
             "  chain input {", "    type filter hook input priority filter; policy accept;"]
    if mine:
        lines += ["    ct state established,related accept", "    iif lo accept",
                  f"    ip saddr {pod.ip} accept"]
        named = {p["name"]: p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", [])
                 if "name" in p}
        for policy in mine:
            for rule in policy["spec"].get("ingress") or []:
                sources: list[str] | None = None  # None: from anywhere
                if rule.get("from"):
                    sources = []
                    for peer in rule["from"]:
                        if "ipBlock" in peer:
                            block = peer["ipBlock"]
                            if block.get("except"):
                                raise ReplayError("ipBlock.except is not replayed")
                            sources.append(block["cidr"])
                        else:
                            sources += peers(peer.get("podSelector"), peer.get("namespaceSelector"))
                    if not sources:
                        continue  # selects no pod now
                ports = []
                for p in rule.get("ports") or [None]:
                    if p is None:
                        ports.append("")
                        continue
                    if p.get("protocol", "TCP") != "TCP":
                        raise ReplayError("only TCP ports are replayed")
                    port = p["port"]
                    if isinstance(port, str):
                        if port not in named:
                            continue  # a named port this pod does not have admits nothing here
                        port = named[port]
                    ports.append(f"tcp dport {port}-{p['endPort']}" if "endPort" in p else f"tcp dport {port}")
                src = "" if sources is None else f"ip saddr {{ {', '.join(sources)} }}"
                lines += ["    " + " ".join(x for x in (src, port, "accept") if x) for port in ports]
        lines.append("    drop")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"
