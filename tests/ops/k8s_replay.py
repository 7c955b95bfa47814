"""Replay rendered Kubernetes manifests on one machine: the next best check to a cluster.

Kubernetes itself cannot run here, so this runs what the rendered objects declare, as a kubelet
and the workload controllers would, with the host's Python standing in for the image:

* every pod of a Job (Indexed or not), Deployment or StatefulSet runs its container's command and
  args (the image's ENTRYPOINT/CMD, ENV and WORKDIR read from the Dockerfile's target where the
  manifest leaves them out), with ``$(VAR)`` expanded as Kubernetes does, its env (values,
  fieldRef, resourceFieldRef, secretKeyRef, configMapKeyRef), as ``runAsUser``/``runAsGroup`` with
  ``fsGroup`` as a supplementary group, without capabilities and with no_new_privs, in a root of its
  own (read-only when ``readOnlyRootFilesystem``), in its own PID, mount, UTS and IPC namespaces;
* its volumes: Secrets and ConfigMaps as files with the manifest's modes, owned by root (group
  ``fsGroup`` when set, as the kubelet makes them), emptyDirs, and PersistentVolumeClaims as
  folders that outlive the pods (new volumes root-owned 0755, as a fresh file system's root);
* its network: each datacenter's pods in network namespaces of their own with the addresses the
  manifests and deploy/README.md assume, ``hostNetwork`` pods in their node's namespace, routed
  (no address translation) through one router namespace that plays the interconnect and
  kube-proxy (ClusterIP and LoadBalancer Services are DNAT rules there, ``loadBalancerSourceRanges``
  enforced), namespaced sysctls, NetworkPolicies (Ingress) as nftables rules in each selected pod's
  namespace, Services' and pods' names in each pod's /etc/hosts (what cluster DNS would answer);
* the kubelet: httpGet and tcpSocket startup, liveness and readiness probes (periods and
  timeouts scaled by ``time_scale``, timeouts at least 1 s; a failed liveness or startup probe
  ends the container as a deletion does; Services and load balancers forward to ready pods only,
  or to every pod with ``publishNotReadyAddresses``); a deleted pod gets SIGTERM, then SIGKILL
  when its ``terminationGracePeriodSeconds`` (scaled, at least ``min_grace_s``) ends, with the
  DisruptionTarget condition when it is an eviction, a preemption or a node-pressure eviction;
  ReadWriteOnce claims attached to one node at a time (a pod on another node stays Pending),
  fsGroup applied to a claim as its driver's ``fsGroupPolicy`` says;
* the controllers: a Job's completions, parallelism, podFailurePolicy (exit codes and the
  DisruptionTarget condition), backoffLimit and backoffLimitPerIndex/maxFailedIndexes (delays
  scaled by ``time_scale``), completion; a Deployment's or StatefulSet's ``restartPolicy: Always``
  (containers restarted in place with the crash-loop delays, scaled); PodDisruptionBudgets when
  draining; a load balancer that forwards ``lb_delay_s`` after its pod became ready; a
  datacenter's source NAT on pod egress (``Datacenter.pod_egress``, routed or not).

What it cannot honour, and says so in ``UNSUPPORTED``: CPU and memory limits (no cgroups are
set), exec and gRPC probes, scheduling (node selectors, affinities: one node per host-network pod,
pod index i of a Job on node i), seccomp profiles, image pulls (the host's installation, with this
repository first on PYTHONPATH, is the image).

Needs root, ``ip``, ``unshare``, ``setpriv``, ``chroot`` and ``nft``. Every namespace, process and
file it makes is removed by ``close()``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from k8s_network import ROUTER_GW, Datacenter, Network
from k8s_semantics import (
    Image,
    ReplayError,
    expand,
    failure_action,
    may_evict,
    policy_ruleset,
    quantity,
    selects,
)

UNSUPPORTED = ("resources (cpu/memory limits are not enforced)", "exec and gRPC probes",
               "scheduling (nodeSelector, affinity, tolerations)", "seccompProfile", "image pulls")
MIN_GRACE_S = 10.0  # the shortest grace period the replay gives a terminating pod, however scaled
MIN_PROBE_TIMEOUT_S = 1.0  # Kubernetes' smallest timeoutSeconds


# --- pods ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Pod:
    name: str
    dc: str
    owner: "Workload"
    index: int
    spec: dict
    labels: dict[str, str]
    annotations: dict[str, str]
    hostname: str
    subdomain: str | None
    ip: str = ""
    netns: str = ""
    node: str | None = None
    dir: Path = Path()
    proc: subprocess.Popen | None = None
    phase: str = "Pending"
    exit_code: int | None = None
    restarts: int = 0
    disrupted: bool = False
    next_restart: float = 0.0
    started_at: float = 0.0
    #: set by delete/evict: when the kubelet sends SIGKILL (the grace period's end), and why it was ended
    kill_at: float | None = None
    ended_by: str = ""
    ready: bool = False
    ready_since: float = 0.0
    #: the kubelet's probes of the current container: {kind: {"next": t, "failures": n, "ok": n, "fail": n}}
    probes: dict = dataclasses.field(default_factory=dict)
    started_ok: bool = False  # the startupProbe succeeded (or there is none)

    @property
    def log(self) -> Path:
        return self.dir / "container.log"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def container_pid(self) -> int | None:
        """The host PID of the container's process (PID 2 of the pod's PID namespace; PID 1 is the
        shell that set the pod up and records the container's exit code)."""
        if self.proc is None or self.proc.poll() is not None or not (self.dir / "started").exists():
            return None  # not started, or still being set up (its volumes, its root)
        init = _children(self.proc.pid)
        found = _children(init[0]) if init else []
        return found[0] if found else None


def _probe(pod: Pod, probe: dict, timeout: float, state: dict) -> None:
    """One probe of ``pod`` (in a thread of its own, which enters the pod's network namespace: the
    kubelet's probes reach the pod whatever its NetworkPolicies say); the result goes to state."""
    import ctypes
    import http.client
    import socket

    try:
        fd = os.open(f"/run/netns/{pod.netns}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET, this thread only
                raise OSError(ctypes.get_errno(), "setns")
        finally:
            os.close(fd)
        named = {p["name"]: p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", []) if "name" in p}
        how = probe.get("httpGet") or probe["tcpSocket"]
        port = named[how["port"]] if isinstance(how["port"], str) else int(how["port"])
        host = how.get("host", pod.ip)
        if "httpGet" in probe:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                conn.request("GET", how.get("path", "/"), headers={"User-Agent": "kube-probe/1.29"})
                status = conn.getresponse().status
            finally:
                conn.close()
            state["result"] = (200 <= status < 400, f"HTTP {status}")
        else:
            socket.create_connection((host, port), timeout=timeout).close()
            state["result"] = (True, "")
    except Exception as e:  # noqa: BLE001 - every failure is a failed probe
        state["result"] = (False, f"{type(e).__name__}: {e}"[:200])


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@dataclasses.dataclass
class Workload:
    obj: dict
    dc: str
    pods: dict[int, Pod] = dataclasses.field(default_factory=dict)
    succeeded: set[int] = dataclasses.field(default_factory=set)
    failures: int = 0
    status: str = "Running"  # Job: Running, Complete, Failed
    reason: str = ""
    next_start: dict[int, float] = dataclasses.field(default_factory=dict)
    index_failures: dict[int, int] = dataclasses.field(default_factory=dict)  # backoffLimitPerIndex's counts
    failed_indexes: set[int] = dataclasses.field(default_factory=set)
    history: list[dict] = dataclasses.field(default_factory=list)  # every pod that ended: name, phase, exit code

    @property
    def kind(self) -> str:
        return self.obj["kind"]

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]


class Replay:
    """Runs the rendered objects of each datacenter (``{datacenter: objects}``) on this machine."""

    def __init__(self, workdir: Path, datacenters: dict[str, Datacenter], rendered: dict[str, list[dict]], *,
                 secrets: dict[str, dict[str, dict[str, bytes]]], image: Image, repo: Path, time_scale: float = 0.1,
                 monitoring: dict[str, str] | None = None, node_setup: dict[str, Callable[[str], None]] | None = None,
                 pod_network: dict[str, bool] | None = None, probes: bool = True, lb_delay_s: float = 0.0,
                 fs_group_policy: dict[tuple[str, str], str] | None = None) -> None:
        if os.geteuid() != 0:
            raise ReplayError("the replay needs root (network namespaces, mounts, other users)")
        for tool in ("ip", "unshare", "setpriv", "chroot", "nft"):
            if shutil.which(tool) is None:
                raise ReplayError(f"the replay needs {tool} on PATH")
        self.workdir = workdir
        self.dcs = datacenters
        self.rendered = rendered
        self.secrets = secrets
        self.image = image
        self.repo = repo
        self.time_scale = time_scale
        #: run the containers' startup, liveness and readiness probes as the kubelet does (periods
        #: and timeouts scaled by time_scale, timeouts at least MIN_PROBE_TIMEOUT_S)
        self.probes = probes
        #: a LoadBalancer Service forwards to a pod only this long after the pod became ready (a
        #: cloud balancer's health checks and programming lag behind the endpoints)
        self.lb_delay_s = lb_delay_s
        self._lb_pending: set[str] = set()
        self._lb_due = math.inf
        self.min_grace_s = MIN_GRACE_S
        #: {(datacenter, claim): the CSI driver's fsGroupPolicy}: File (the kubelet applies fsGroup;
        #: the default here), ReadWriteOnceWithFSType (Kubernetes' default: only on ReadWriteOnce
        #: volumes, so not on an NFS-style ReadWriteMany one), None (never)
        self.fs_group_policy = fs_group_policy or {}
        self._attached: dict[tuple[str, str], str] = {}  # a ReadWriteOnce claim -> the node it is attached to
        self.events: list[str] = []
        self.pods: list[Pod] = []
        self.workloads: list[Workload] = []
        self._lock = threading.RLock()
        self._t0 = time.monotonic()
        self.net = Network(f"rp{os.getpid() % 100000}")
        self._closed = False
        self._spawned: list[subprocess.Popen] = []
        self._node_setup = node_setup or {}
        self._node_ns: dict[tuple[str, str], str] = {}
        self._node_busy: dict[tuple[str, str], str | None] = {}
        self.service_ips: dict[tuple[str, str], str] = {}
        self.monitoring: dict[str, tuple[str, str]] = {}  # dc -> (netns, ip) of a pod in namespace monitoring
        #: called (with this replay) whenever the set of running pods changed, after the network follows
        self.on_change: list[Callable[["Replay"], None]] = []
        try:
            for dc, objects in rendered.items():
                for obj in objects:
                    if obj["kind"] in ("Job", "Deployment", "StatefulSet"):
                        self.workloads.append(Workload(obj, dc))
                    elif obj["kind"] == "Service":
                        self._plan_service(dc, obj)
            for dc, ip in (monitoring or {}).items():
                self.monitoring[dc] = (self.net.attach(f"mon-{dc}", ip), ip)
                self._event(f"{dc}: a pod of namespace monitoring at {ip}")
        except BaseException:
            self.close()
            raise

    # -- bookkeeping --------------------------------------------------------------------------------
    def _event(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self._t0:7.1f}s {text}")

    def objects(self, dc: str, kind: str) -> list[dict]:
        return [o for o in self.rendered[dc] if o["kind"] == kind]

    def workload(self, name: str, dc: str | None = None) -> Workload:
        found = [w for w in self.workloads if w.name == name and (dc is None or w.dc == dc)]
        if len(found) != 1:
            raise ReplayError(f"{len(found)} workloads named {name}")
        return found[0]

    def running(self) -> list[Pod]:
        return [p for p in self.pods if p.phase == "Running"]

    # -- services and names ----------------------------------------------------------------------------
    def _plan_service(self, dc: str, svc: dict) -> None:
        spec = svc["spec"]
        if spec.get("clusterIP") == "None":
            return  # headless: names of its pods (hostname.subdomain)
        key = (dc, svc["metadata"]["name"])
        self.service_ips[key] = self.dcs[dc].next_service_ip()
        if spec.get("type") == "LoadBalancer":
            self.service_ips[(dc, svc["metadata"]["name"] + "@lb")] = self.dcs[dc].next_lb_ip()

    def _hosts(self, pod: Pod) -> str:
        dc = self.dcs[pod.dc]
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        if pod.spec.get("hostNetwork"):
            lines.append(f"{pod.ip} {pod.node}")
        else:
            full = f"{pod.hostname}.{pod.subdomain}" if pod.subdomain else pod.hostname
            lines.append(f"{pod.ip} {full} {pod.hostname}" if full != pod.hostname else f"{pod.ip} {pod.hostname}")
        for (sdc, name), ip in self.service_ips.items():
            if sdc == pod.dc and not name.endswith("@lb"):
                lines.append(f"{ip} {name}")
        for other in self.running():  # what cluster DNS answers for a headless Service's pods
            if other.dc == pod.dc and other.subdomain and (other is not pod or pod.spec.get("hostNetwork")):
                lines.append(f"{other.ip} {other.hostname}.{other.subdomain}")
        for name, target in dc.names.items():
            ip = self.service_ips.get(tuple(target.split("/", 1))) if "/" in target else target
            if ip:
                lines.append(f"{ip} {name}")
        return "\n".join(lines) + "\n"

    def _refresh_network(self) -> None:
        """Rewrite every pod's /etc/hosts, the Services' DNAT rules and the NetworkPolicies' rules
        for the pods running now (what cluster DNS, kube-proxy and the network plugin keep current)."""
        with self._lock:
            for pod in self.running():
                (pod.dir / "hosts").write_text(self._hosts(pod))
            for dc, objects in self.rendered.items():
                for svc in (o for o in objects if o["kind"] == "Service"):
                    self._service_rules(dc, svc)
                policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
                for pod in self.running():
                    if pod.dc == dc and not pod.spec.get("hostNetwork"):
                        ruleset = policy_ruleset(pod, policies, lambda ps, ns, dc=dc: self._peers(dc, ps, ns))
                        self.net.exec(pod.netns, "nft", "-f", "-", input=ruleset)
            for hook in self.on_change:
                hook(self)

    def _peers(self, dc: str, pod_selector: dict | None, ns_selector: dict | None) -> list[str]:
        if ns_selector is not None:
            names = (ns_selector.get("matchLabels") or {}).get("kubernetes.io/metadata.name")
            if names == "monitoring" and dc in self.monitoring and not pod_selector:
                return [self.monitoring[dc][1]]
            if names == "monitoring":
                return []
            raise ReplayError(f"namespaceSelector {ns_selector} is not replayed")
        return [p.ip for p in self.running() if p.dc == dc and selects(pod_selector, p.labels)]

    def _service_rules(self, dc: str, svc: dict) -> None:
        spec, name = svc["spec"], svc["metadata"]["name"]
        if spec.get("clusterIP") == "None":
            return
        backends = [p for p in self.running() if p.dc == dc and selects({"matchLabels": spec["selector"]}, p.labels)
                    and (p.ready or spec.get("publishNotReadyAddresses"))]
        statements, filters = [], []
        if backends:
            pod = backends[0]
            lb_ready = time.monotonic() >= pod.ready_since + self.lb_delay_s
            named = {p["name"]: p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", [])}
            for port in spec["ports"]:
                target = port.get("targetPort", port["port"])
                target = named[target] if isinstance(target, str) else target
                statements.append(f"    ip daddr {self.service_ips[(dc, name)]} tcp dport {port['port']} "
                                  f"dnat to {pod.ip}:{target}")
                if spec.get("type") == "LoadBalancer" and not lb_ready:
                    if f"{dc}/{name}" not in self._lb_pending:
                        self._event(f"{dc}: load balancer {name} not ready yet ({self.lb_delay_s:g}s after its pod)")
                    self._lb_pending.add(f"{dc}/{name}")
                    self._lb_due = min(self._lb_due, pod.ready_since + self.lb_delay_s)
                elif spec.get("type") == "LoadBalancer":
                    if f"{dc}/{name}" in self._lb_pending:
                        self._event(f"{dc}: load balancer {name} ready")
                    self._lb_pending.discard(f"{dc}/{name}")
                    lb = self.service_ips[(dc, name + "@lb")]
                    ranges = spec.get("loadBalancerSourceRanges")
                    if ranges:
                        filters.append(f"    ct direction original ct original ip daddr {lb} "
                                       f"ip saddr != {{ {', '.join(ranges)} }} drop")
                    if spec.get("externalTrafficPolicy") != "Local":
                        raise ReplayError(f"{name}: only externalTrafficPolicy Local (no SNAT) is replayed")
                    statements.append(f"    ip daddr {lb} tcp dport {port['port']} dnat to {pod.ip}:{target}")
        self.net.set_nat(f"{dc}/{name}", filters, statements)

    # -- volumes ----------------------------------------------------------------------------------------
    def _volume(self, pod: Pod, volume: dict, fs_group: int | None, pvcs: Path) -> Path:
        name = volume["name"]
        path = pod.dir / "volumes" / name
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if not any(o["metadata"]["name"] == claim for o in self.objects(pod.dc, "PersistentVolumeClaim")):
                raise ReplayError(f"pod {pod.name}: PersistentVolumeClaim {claim} is not in the manifests")
            path = pvcs / pod.dc / claim
            if not path.exists():  # a fresh volume: its file system's root belongs to root
                path.mkdir(parents=True)
                path.chmod(0o755)
                self._event(f"{pod.dc}: bound PersistentVolumeClaim {claim}")
            modes = next(o for o in self.objects(pod.dc, "PersistentVolumeClaim")
                         if o["metadata"]["name"] == claim)["spec"].get("accessModes", [])
            policy = self.fs_group_policy.get((pod.dc, claim), "File")
            if policy not in ("File", "ReadWriteOnceWithFSType", "None"):
                raise ReplayError(f"fsGroupPolicy {policy} does not exist")
            applied = policy == "File" or (policy == "ReadWriteOnceWithFSType" and modes == ["ReadWriteOnce"])
            if fs_group is not None and not applied:
                self._event(f"{pod.dc}: fsGroup not applied to {claim} ({'/'.join(modes)}, fsGroupPolicy {policy})")
            if fs_group is not None and applied:
                for p in [path, *path.rglob("*")]:
                    os.lchown(p, -1, fs_group)
                    if not p.is_symlink():
                        p.chmod(p.stat().st_mode | (0o2770 if p.is_dir() else 0o660))
            return path
        if path.exists():
            return path  # a container restarted in place keeps its pod's volumes
        path.mkdir(parents=True)
        if "emptyDir" in volume:
            path.chmod(0o777)
            if fs_group is not None:
                os.chown(path, -1, fs_group)
                path.chmod(0o2777)
            return path
        if "secret" in volume or "configMap" in volume:
            kind = "secret" if "secret" in volume else "configMap"
            source = volume[kind]
            ref = source["secretName"] if kind == "secret" else source["name"]
            data = self._data(pod.dc, kind, ref)
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] not in data:
                    raise ReplayError(f"pod {pod.name}: {kind} {ref} has no key {item['key']}")
                f = path / item["path"]
                f.write_bytes(data[item["key"]])
                mode = item.get("mode", source.get("defaultMode", 0o644))
                os.chown(f, 0, fs_group if fs_group is not None else 0)
                f.chmod(mode | 0o440 if fs_group is not None else mode)
            os.chown(path, 0, fs_group if fs_group is not None else 0)
            path.chmod(0o2755 if fs_group is not None else 0o755)
            return path
        raise ReplayError(f"pod {pod.name}: volume {name} of a kind the replay does not know: {sorted(volume)}")

    def _data(self, dc: str, kind: str, name: str) -> dict[str, bytes]:
        if kind == "secret":
            if name not in self.secrets.get(dc, {}):
                raise ReplayError(f"{dc}: Secret {name} does not exist (CreateContainerConfigError)")
            return self.secrets[dc][name]
        for cm in self.objects(dc, "ConfigMap"):
            if cm["metadata"]["name"] == name:
                return {k: v.encode() for k, v in (cm.get("data") or {}).items()}
        raise ReplayError(f"ConfigMap {name} does not exist")

    # -- starting a pod ---------------------------------------------------------------------------------
    def _env(self, pod: Pod, container: dict) -> dict[str, str]:
        env = dict(self.image.env)
        env["HOSTNAME"] = pod.node if pod.spec.get("hostNetwork") else pod.hostname
        env["HOME"] = "/home/diloco" if self._uid(pod, container) == 10001 else "/"
        # the image holds this repository's code: the host's installation may be an editable install
        # of another checkout, so the repository (bound at its own path) comes first
        env["PYTHONPATH"] = str(self.repo)
        if pod.owner.kind == "Job" and pod.owner.obj["spec"].get("completionMode") == "Indexed":
            env["JOB_COMPLETION_INDEX"] = str(pod.index)
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
                continue
            source = e["valueFrom"]
            if "fieldRef" in source:
                env[e["name"]] = self._field(pod, source["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in source:
                ref = source["resourceFieldRef"]
                target = next(c for c in pod.spec["containers"] if c["name"] == ref.get("containerName", container["name"]))
                kind, _, res = ref["resource"].partition(".")
                value = (target.get("resources") or {}).get(kind, {}).get(res)
                if value is None:
                    raise ReplayError(f"{pod.name}: {ref['resource']} is not set")
                env[e["name"]] = str(math.ceil(quantity(value) / quantity(ref.get("divisor", "1"))))
            elif "secretKeyRef" in source or "configMapKeyRef" in source:
                kind = "secret" if "secretKeyRef" in source else "configMap"
                ref = source["secretKeyRef" if kind == "secret" else "configMapKeyRef"]
                data = self._data(pod.dc, kind, ref["name"])
                if ref["key"] not in data:
                    raise ReplayError(f"{pod.name}: {kind} {ref['name']} has no key {ref['key']}")
                env[e["name"]] = data[ref["key"]].decode()
            else:
                raise ReplayError(f"{pod.name}: env {e['name']} from {sorted(source)} is not replayed")
        return env

    def _field(self, pod: Pod, path: str) -> str:
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if m:
            source = pod.labels if m.group(1) == "labels" else pod.annotations
            if m.group(2) not in source:
                raise ReplayError(f"{pod.name}: {path} is not set on the pod")
            return source[m.group(2)]
        values = {"metadata.name": pod.name, "metadata.namespace": self._namespace(pod), "status.podIP": pod.ip,
                  "status.hostIP": pod.ip if pod.spec.get("hostNetwork") else ROUTER_GW,
                  "spec.nodeName": pod.node or f"{pod.dc}-node-{pod.index}",
                  "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default")}
        if path not in values:
            raise ReplayError(f"{pod.name}: fieldRef {path} is not replayed")
        return values[path]

    def _namespace(self, pod: Pod) -> str:
        return pod.owner.obj["metadata"].get("namespace", "default")

    def _uid(self, pod: Pod, container: dict) -> int:
        ctx = {**(pod.spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
        if "runAsUser" in ctx:
            return int(ctx["runAsUser"])
        user = self.image.user.split(":")[0]
        return int(user) if user.isdigit() else 0

    def _node_of(self, pod: Pod) -> str:
        return pod.node or f"{pod.dc}-node-{pod.index}"

    def _attach(self, pod: Pod) -> bool:
        """Attach the pod's ReadWriteOnce claims to its node; False (the pod stays Pending, as in
        ContainerCreating with a Multi-Attach error) while one is attached to another node with a
        running pod. ReadWriteMany and ReadOnlyMany claims attach anywhere."""
        node = self._node_of(pod)
        wanted = []
        for v in pod.spec.get("volumes", []):
            if "persistentVolumeClaim" not in v:
                continue
            claim = v["persistentVolumeClaim"]["claimName"]
            obj = next((o for o in self.objects(pod.dc, "PersistentVolumeClaim") if o["metadata"]["name"] == claim), None)
            if obj is None or obj["spec"].get("accessModes", []) not in (["ReadWriteOnce"], ["ReadWriteOncePod"]):
                continue
            key = (pod.dc, claim)
            users = [p for p in self.running() if p is not pod and p.dc == pod.dc and any(
                u.get("persistentVolumeClaim", {}).get("claimName") == claim for u in p.spec.get("volumes", []))]
            if obj["spec"]["accessModes"] == ["ReadWriteOncePod"] and users:
                return self._unattached(pod, f"{claim} is ReadWriteOncePod and used by {users[0].name}")
            if self._attached.get(key, node) != node and any(self._node_of(u) == self._attached[key] for u in users):
                return self._unattached(pod, f"Multi-Attach error: {claim} (ReadWriteOnce) is attached to "
                                        f"{self._attached[key]}, the pod is on {node}")
            wanted.append(key)
        for key in wanted:
            self._attached[key] = node
        return True

    def _unattached(self, pod: Pod, why: str) -> bool:
        if pod.phase != "Pending" or not pod.ended_by:
            self._event(f"{pod.dc}: pod {pod.name} stays Pending: {why}")
        pod.phase, pod.ended_by = "Pending", why
        return False

    def _start(self, pod: Pod) -> None:
        """Start (or restart in place) the pod's one container."""
        if not self._attach(pod):
            return
        spec = pod.spec
        (container,) = spec["containers"]
        if spec.get("initContainers"):
            raise ReplayError("init containers are not replayed")
        pod_ctx = spec.get("securityContext") or {}
        ctx = {**pod_ctx, **(container.get("securityContext") or {})}
        uid = self._uid(pod, container)
        gid = int(ctx.get("runAsGroup", uid if ctx.get("runAsUser") is not None else 0))
        if ctx.get("runAsNonRoot") and uid == 0:
            raise ReplayError(f"{pod.name}: runAsNonRoot with uid 0 (CreateContainerConfigError)")
        fs_group = pod_ctx.get("fsGroup")
        groups = sorted({int(fs_group)} | {int(g) for g in pod_ctx.get("supplementalGroups", [])}
                        if fs_group is not None else {int(g) for g in pod_ctx.get("supplementalGroups", [])})
        volumes = {v["name"]: self._volume(pod, v, fs_group, self.workdir / "pvcs") for v in spec.get("volumes", [])}
        env = self._env(pod, container)
        command = container.get("command") or self.image.entrypoint
        args = container.get("args") if "args" in container else ([] if "command" in container else self.image.cmd)
        argv = [expand(a, env) for a in [*command, *args]]
        if not argv:
            raise ReplayError(f"{pod.name}: nothing to run")
        (pod.dir / "hosts").write_text(self._hosts(pod))
        (pod.dir / "passwd").write_text(f"root:x:0:0:root:/root:/bin/sh\ndiloco:x:10001:10001::/home/diloco:/usr/sbin/nologin\n")
        (pod.dir / "group").write_text("root:x:0:\ndiloco:x:10001:\n")
        # names come from /etc/hosts (what cluster DNS would answer); a DNS query is refused at once,
        # and never leaves the pod for the host's resolver
        (pod.dir / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        root = pod.dir / "root"
        root.mkdir(exist_ok=True)
        prefixes = sorted({sys.prefix, sys.base_prefix})
        mounts = []
        for m in container.get("volumeMounts", []):
            if m.get("subPath"):
                raise ReplayError("subPath mounts are not replayed")
            src = volumes[m["name"]]
            mounts.append((str(src), m["mountPath"], bool(m.get("readOnly")), m["mountPath"] == "/dev/shm"))
        script = self._setup_script(root, pod, prefixes, mounts, bool(ctx.get("readOnlyRootFilesystem")))
        env_args = [f"{k}={v}" for k, v in env.items()]
        workdir = container.get("workingDir") or self.image.workdir
        caps = ["--inh-caps=-all", "--bounding-set=-all"]
        if ctx.get("capabilities", {}).get("add"):
            raise ReplayError("added capabilities are not replayed")
        exec_line = ["exec", "chroot", str(root), "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}",
                     f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups", *caps,
                     *(["--no-new-privs"] if ctx.get("allowPrivilegeEscalation") is False else []),
                     "/usr/bin/env", "-i", "-C", workdir, *env_args, *argv]
        exit_file = shlex.quote(str(pod.dir / "exit_code"))
        (pod.dir / "started").unlink(missing_ok=True)
        (pod.dir / "setup.sh").write_text(
            script + f": > {shlex.quote(str(pod.dir / 'started'))}\n" + " ".join(shlex.quote(a) for a in exec_line[1:]) + " &\n"  # the container: PID 2, this shell's child
            f"set +e\nexec 2>/dev/null\nwait $!\ncode=$?\necho $code > {exit_file}\nexit $code\n")
        unshare = ["unshare", "--mount", "--uts", "--ipc", "--pid", "--fork", "--kill-child", "--propagation", "private",
                   "/bin/sh", "-e", str(pod.dir / "setup.sh")]
        cmd = ["ip", "netns", "exec", pod.netns, *unshare]
        log = open(pod.log, "ab")
        try:
            pod.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        finally:
            log.close()
        pod.phase, pod.exit_code, pod.started_at = "Running", None, time.monotonic()
        pod.kill_at, pod.ended_by, pod.disrupted = None, "", False
        self._arm_probes(pod, container)
        (pod.dir / "argv.json").write_text(json.dumps({"argv": argv, "env": sorted(env), "uid": uid, "gid": gid,
                                                      "groups": groups}))
        self._event(f"{pod.dc}: started pod {pod.name} ({pod.ip}{', host network' if spec.get('hostNetwork') else ''})"
                    f" as {uid}:{gid} groups {groups}: {' '.join(argv[:3])} ...")

    def _setup_script(self, root: Path, pod: Pod, prefixes: list[str], mounts: list, read_only: bool) -> str:
        """Shell run as root in the pod's new namespaces: builds its root file system from the host's
        (read-only) with the installation at its own path and at /opt/venv (the image's), the pod's
        /etc files and volumes, then the exec line follows."""
        q = shlex.quote
        r = q(str(root))
        lines = ["set -e", "mount --make-rprivate /", f"mount -t tmpfs -o mode=0755 tmpfs {r}"]
        for d in ("usr", "etc", "proc", "sys", "dev", "opt/venv", "root", "home/diloco", "tmp", "var", "run"):
            lines.append(f"mkdir -p {r}/{d}")
        for link in ("bin", "lib", "lib64", "sbin"):
            target = os.readlink(f"/{link}") if os.path.islink(f"/{link}") else None
            if target:
                lines.append(f"ln -s {q(target)} {r}/{link}")
            elif os.path.isdir(f"/{link}"):
                lines += [f"mkdir -p {r}/{link}", f"mount --rbind -o ro /{link} {r}/{link}"]
        upper, work = pod.dir / "etc-upper", pod.dir / "etc-work"
        lines += [f"mount --bind /usr {r}/usr", f"mount -o remount,bind,ro {r}/usr",
                  f"mkdir -p {q(str(upper))} {q(str(work))}",  # the host's /etc, below what the pod adds
                  f"mount -t overlay overlay -o lowerdir=/etc,upperdir={q(str(upper))},workdir={q(str(work))} {r}/etc"]
        for name in ("hosts", "passwd", "group", "resolv.conf"):
            lines.append(f"mount --bind {q(str(pod.dir / name))} {r}/etc/{name}")
        lines += [f"mount --rbind /sys {r}/sys", f"mount --rbind /dev {r}/dev", f"mount -t proc proc {r}/proc"]
        lines += [f"mount --bind {q(sys.prefix)} {r}/opt/venv", f"mount -o remount,bind,ro {r}/opt/venv"]
        lines.append(f"chown 10001:10001 {r}/home/diloco")
        for src, target, ro, shm in mounts:
            t = f"{r}{q(target)}"
            lines.append(f"mkdir -p {t}")
            if shm:
                lines.append(f"mount -t tmpfs -o mode=1777,size=1g tmpfs {t}")
            else:
                lines.append(f"mount --bind {q(src)} {t}")
                if ro:
                    lines.append(f"mount -o remount,bind,ro {t}")
        # the installation and the repository at their own paths, over the pod's volumes: a volume at
        # /tmp would otherwise hide an installation under /tmp (a virtual environment's scripts name
        # their interpreter by its path there)
        repo = str(self.repo)
        for path in [*prefixes, repo]:
            lines += [f"mkdir -p {r}{q(path)}", f"mount --bind {q(path)} {r}{q(path)}",
                      f"mount -o remount,bind,ro {r}{q(path)}"]
        if pod.spec.get("hostNetwork"):
            lines.append(f"hostname {q(pod.node or 'node')}")
        else:
            lines.append(f"hostname {q(pod.hostname)}")
        if read_only:
            lines.append(f"mount -o remount,ro {r}")
        return "\n".join(lines) + "\n"

    def _new_pod(self, w: Workload, index: int) -> Pod:
        template = w.obj["spec"]["template"]
        labels = dict(template["metadata"].get("labels") or {})
        annotations = dict(template["metadata"].get("annotations") or {})
        spec = json.loads(json.dumps(template["spec"]))
        subdomain = spec.get("subdomain")
        attempt = sum(1 for p in self.pods if p.owner is w and p.index == index)
        if w.kind == "Job":
            labels.update({"batch.kubernetes.io/job-name": w.name, "job-name": w.name})
            if w.obj["spec"].get("completionMode") == "Indexed":
                labels["batch.kubernetes.io/job-completion-index"] = str(index)
                annotations["batch.kubernetes.io/job-completion-index"] = str(index)
                hostname = f"{w.name}-{index}"
            else:
                hostname = f"{w.name}-{attempt}"
            name = f"{w.name}-{index}-r{attempt}"
        elif w.kind == "StatefulSet":
            name = hostname = f"{w.name}-{index}"
            labels["apps.kubernetes.io/pod-index"] = str(index)
            labels["statefulset.kubernetes.io/pod-name"] = name
            subdomain = w.obj["spec"].get("serviceName")
        else:
            name = hostname = f"{w.name}-{index}"
        pod = Pod(name=name, dc=w.dc, owner=w, index=index, spec=spec, labels=labels, annotations=annotations,
                  hostname=spec.get("hostname", hostname), subdomain=subdomain)
        pod.dir = self.workdir / "pods" / name
        pod.dir.mkdir(parents=True)
        dc = self.dcs[w.dc]
        if spec.get("hostNetwork"):
            node = next((n for n in dc.nodes if self._node_busy.get((w.dc, n)) is None), None)
            if node is None:
                node_ip = str(list(ipaddress.ip_network(dc.node_cidr).hosts())[10 + len(dc.nodes)])
                node = f"{w.dc}-node-{len(dc.nodes)}"
                ns = self.net.attach(node, node_ip, ifname=dc.node_ifname)
                self._node_ns[(w.dc, node)] = ns
                dc.nodes.append(node)
                self._event(f"{w.dc}: node {node} at {node_ip} on {dc.node_ifname}")
                for setup in [self._node_setup.get(w.dc)]:
                    if setup is not None:
                        setup(ns)
            pod.node, pod.netns = node, self._node_ns[(w.dc, node)]
            pod.ip = self.net.exec(pod.netns, "ip", "-4", "-o", "addr", "show", "dev", dc.node_ifname).stdout.split()[3].split("/")[0]
            self._node_busy[(w.dc, node)] = name
            if spec.get("securityContext", {}).get("sysctls"):
                raise ReplayError(f"{name}: a host-network pod may not set namespaced sysctls (the kubelet refuses it)")
        else:
            pod.ip = dc.next_pod_ip()
            pod.netns = self.net.attach(name, pod.ip)
            for s in (spec.get("securityContext") or {}).get("sysctls", []):
                self.net.exec(pod.netns, "sysctl", "-qw", f"{s['name']}={s['value']}")
        self.pods.append(pod)
        return pod

    # -- the kubelet's probes -----------------------------------------------------------------------------
    def _arm_probes(self, pod: Pod, container: dict) -> None:
        pod.probes = {}
        for kind in ("startup", "liveness", "readiness"):
            probe = container.get(f"{kind}Probe")
            if probe is None or not self.probes:
                continue
            if not ({"httpGet", "tcpSocket"} & set(probe)):
                raise ReplayError(f"{pod.name}: {kind}Probe {sorted(probe)} is not replayed (httpGet and tcpSocket are)")
            pod.probes[kind] = {"spec": probe, "failures": 0, "successes": 0, "ok": 0, "failed": 0, "result": None,
                                "thread": None, "next": time.monotonic() + float(probe.get("initialDelaySeconds", 0))
                                * self.time_scale, "last_error": ""}
        pod.started_ok = "startup" not in pod.probes
        pod.ready = "readiness" not in pod.probes and pod.started_ok
        pod.ready_since = time.monotonic()

    def _probe_tick(self, now: float) -> bool:
        """Start the probes that are due, act on the results that came in; True when a pod's
        readiness changed (its Services' endpoints follow)."""
        changed = False
        for pod in self.running():
            if pod.kill_at is not None:
                continue  # terminating: the kubelet stops probing
            for kind, st in pod.probes.items():
                probe = st["spec"]
                if st["result"] is not None:
                    ok, error = st["result"]
                    st["result"], st["thread"] = None, None
                    if ok:
                        st["ok"] += 1
                        st["successes"] += 1
                        st["failures"] = 0
                        if kind == "startup" and not pod.started_ok:
                            pod.started_ok = True
                            self._event(f"{pod.dc}: pod {pod.name} started (startupProbe)")
                            if "readiness" not in pod.probes:
                                pod.ready, pod.ready_since, changed = True, now, True
                        if (kind == "readiness" and not pod.ready
                                and st["successes"] >= int(probe.get("successThreshold", 1))):
                            pod.ready, pod.ready_since, changed = True, now, True
                            self._event(f"{pod.dc}: pod {pod.name} ready")
                    else:
                        st["failed"] += 1
                        st["failures"] += 1
                        st["successes"] = 0
                        st["last_error"] = error
                        if st["failures"] >= int(probe.get("failureThreshold", 3)):
                            if kind == "readiness":
                                if pod.ready:
                                    pod.ready, changed = False, True
                                    self._event(f"{pod.dc}: pod {pod.name} not ready: {error}")
                            else:  # the kubelet kills the container; restartPolicy decides the rest
                                self.delete(pod, reason=f"{kind} probe failed {st['failures']} times ({error}):")
                                break
                if kind != "startup" and not pod.started_ok:
                    continue
                if kind == "startup" and pod.started_ok:
                    continue
                if st["thread"] is None and now >= st["next"]:
                    st["next"] = now + max(float(probe.get("periodSeconds", 10)) * self.time_scale, 0.2)
                    timeout = float(probe.get("timeoutSeconds", 1))
                    timeout = min(timeout, max(timeout * self.time_scale, MIN_PROBE_TIMEOUT_S))
                    st["thread"] = threading.Thread(target=_probe, args=(pod, probe, timeout, st), daemon=True)
                    st["thread"].start()
        return changed

    # -- controllers ------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            for name, dc in self.dcs.items():
                if dc.pod_egress is not None:
                    self._unrouted_pods(name, dc)
            for w in self.workloads:
                self._reconcile(w)
            self._refresh_network()

    def _unrouted_pods(self, name: str, dc: Datacenter) -> None:
        """dc's pod network is not routed: from outside, only translated (load-balanced) connections
        reach its pods, and its pods' connections out of it leave from ``dc.pod_egress``."""
        table = f"replay-{name}"
        self.net.exec(self.net.router, "nft", "-f", "-", input=(
            f"table ip {table} {{\n"
            "  chain forward {\n    type filter hook forward priority filter; policy accept;\n"
            "    ct state established,related accept\n"
            "    ct status dnat accept\n"  # what a load balancer or NodePort forwards
            + ("" if dc.pod_routed else f"    ip daddr {dc.pod_cidr} ip saddr != {dc.pod_cidr} drop\n") + "  }\n"
            "  chain postrouting {\n    type nat hook postrouting priority srcnat; policy accept;\n"
            f"    ip saddr {dc.pod_cidr} ip daddr != {dc.pod_cidr} snat to {dc.pod_egress}\n  }}\n}}\n"))
        self._event(f"{name}: pod network {dc.pod_cidr} {'routed' if dc.pod_routed else 'not routed'}; "
                    f"pods leave as {dc.pod_egress}")

    def _reconcile(self, w: Workload) -> None:
        spec = w.obj["spec"]
        now = time.monotonic()
        if w.kind == "Job":
            if w.status != "Running":
                return
            completions = int(spec.get("completions", 1))
            for p in [p for p in w.pods.values() if p.phase == "Pending"]:
                self._start(p)  # waiting for its volume to attach
            running = {i for i, p in w.pods.items() if p.phase in ("Running", "Pending")}
            budget = int(spec.get("parallelism", 1)) - len(running)
            for i in range(completions):
                if budget <= 0:
                    break
                if i in w.succeeded or i in w.failed_indexes or i in running or now < w.next_start.get(i, 0.0):
                    continue
                pod = self._new_pod(w, i)
                w.pods[i] = pod
                self._start(pod)
                budget -= 1
        else:
            replicas = int(spec.get("replicas", 1))
            for i in range(replicas):
                pod = w.pods.get(i)
                if pod is None:
                    pod = w.pods[i] = self._new_pod(w, i)
                    self._start(pod)
                elif pod.phase != "Running" and now >= pod.next_restart:
                    pod.restarts += 1
                    self._start(pod)  # restartPolicy Always: the same pod, a new container

    def tick(self) -> None:
        """Collect exited containers and act as the controllers do; call it often."""
        changed = False
        with self._lock:
            now = time.monotonic()
            for pod in self.running():
                if pod.kill_at is not None and now >= pod.kill_at and pod.proc is not None and pod.proc.poll() is None:
                    self._event(f"{pod.dc}: pod {pod.name}'s grace period ended")
                    pod.kill_at = math.inf
                    self.kill(pod, signal.SIGKILL)
            if self.probes:
                changed |= self._probe_tick(now)
            if now >= self._lb_due:  # a balancer becomes ready
                self._lb_due = math.inf
                changed = True
            for pod in list(self.pods):
                if pod.phase != "Running" or pod.proc is None or pod.proc.poll() is None:
                    continue
                recorded = pod.dir / "exit_code"
                if not recorded.exists():  # the pod's setup failed: the replay's fault, not the pod's
                    raise ReplayError(f"pod {pod.name} could not be set up (exit {pod.proc.returncode}):\n"
                                      f"{pod.log_text()[-3000:]}")
                code = int(recorded.read_text())  # the container's own status (128 + N: killed by signal N)
                recorded.unlink()
                pod.exit_code = code
                changed = True
                self._exited(pod, code)
            for w in self.workloads:
                before = len(self.running())
                self._reconcile(w)
                changed |= len(self.running()) != before
            if changed:
                self._refresh_network()

    def _exited(self, pod: Pod, code: int) -> None:
        w = pod.owner
        restart_policy = pod.spec.get("restartPolicy", "Always")
        if w.kind == "Job" and restart_policy not in ("Never", "OnFailure"):
            raise ReplayError(f"Job {w.name}: restartPolicy {restart_policy} is invalid for a Job")
        if w.kind != "Job":
            pod.phase = "Waiting"  # CrashLoopBackOff between restarts
            delay = min(10.0 * 2 ** min(pod.restarts, 5), 300.0) * self.time_scale
            pod.next_restart = time.monotonic() + delay
            self._event(f"{pod.dc}: container of {pod.name} exited {code}; restarting in {delay:.1f}s "
                        f"(restartPolicy Always, restart {pod.restarts + 1})")
            return
        self._release(pod)
        pod.phase = "Succeeded" if code == 0 else "Failed"
        pod.ready = False
        entry = {"pod": pod.name, "index": pod.index, "phase": pod.phase, "exit_code": code,
                 "ended_by": pod.ended_by or "exited", "disruption_target": pod.disrupted}
        w.history.append(entry)
        spec = w.obj["spec"]
        if code == 0:
            # a pod that exits 0 while being deleted still succeeded: its Job counts the completion
            w.succeeded.add(pod.index)
            self._event(f"{pod.dc}: pod {pod.name} Succeeded" + (f" ({pod.ended_by})" if pod.ended_by else ""))
            self._finish_if_done(w)
            return
        (container,) = pod.spec["containers"]
        action = failure_action(w.obj, container["name"], code, pod.disrupted)
        entry["action"] = action
        self._event(f"{pod.dc}: pod {pod.name} Failed, exit {code}"
                    + (f" ({pod.ended_by}{', DisruptionTarget' if pod.disrupted else ''})" if pod.ended_by else "")
                    + f": podFailurePolicy action {action}")
        per_index = spec.get("backoffLimitPerIndex")
        if action == "FailJob":
            self._fail_job(w, f"pod {pod.name} exited {code}: the podFailurePolicy fails the Job")
        elif action == "FailIndex":
            if per_index is None:
                raise ReplayError(f"Job {w.name}: FailIndex needs backoffLimitPerIndex (the API refuses it)")
            self._fail_index(w, pod.index, f"pod {pod.name} exited {code}: the podFailurePolicy fails the index")
        elif action == "Count":
            w.failures += 1
            failures = w.failures
            if per_index is not None:  # the index's own budget; the Job-wide one defaults to unlimited
                failures = w.index_failures[pod.index] = w.index_failures.get(pod.index, 0) + 1
                if failures > int(per_index):
                    self._fail_index(w, pod.index, f"backoffLimitPerIndex {per_index} reached")
                    return
            limit = spec.get("backoffLimit", None if per_index is not None else 6)
            if limit is not None and w.failures > int(limit):
                self._fail_job(w, f"backoffLimit {limit} reached")
            else:
                delay = min(10.0 * 2 ** (failures - 1), 360.0) * self.time_scale
                w.next_start[pod.index] = time.monotonic() + delay
        elif action == "Ignore":
            w.next_start[pod.index] = time.monotonic()
        else:
            raise ReplayError(f"podFailurePolicy action {action} is not replayed")

    def _fail_index(self, w: Workload, index: int, reason: str) -> None:
        w.failed_indexes.add(index)
        self._event(f"{w.dc}: Job {w.name} index {index} Failed: {reason}")
        most = w.obj["spec"].get("maxFailedIndexes")
        if most is not None and len(w.failed_indexes) > int(most):
            self._fail_job(w, f"{len(w.failed_indexes)} failed indexes, more than maxFailedIndexes {most}")
        else:
            self._finish_if_done(w)

    def _finish_if_done(self, w: Workload) -> None:
        completions = int(w.obj["spec"].get("completions", 1))
        if len(w.succeeded) == completions:
            w.status = "Complete"
            self._event(f"{w.dc}: Job {w.name} Complete (ttlSecondsAfterFinished: "
                        f"{w.obj['spec'].get('ttlSecondsAfterFinished', 'unset')})")
        elif w.failed_indexes and len(w.succeeded | w.failed_indexes) == completions:
            self._fail_job(w, f"indexes {sorted(w.failed_indexes)} failed")

    def _fail_job(self, w: Workload, reason: str) -> None:
        w.status, w.reason = "Failed", reason
        self._event(f"{w.dc}: Job {w.name} Failed: {reason}")
        for pod in w.pods.values():
            if pod.phase == "Running":
                self.kill(pod, signal.SIGKILL, wait=True)
                pod.phase = "Failed"

    def _release(self, pod: Pod) -> None:
        if pod.node is not None:
            self._node_busy[(pod.dc, pod.node)] = None
        elif pod.netns:
            self.net.remove(pod.netns)

    # -- actions -----------------------------------------------------------------------------------------
    def kill(self, pod: Pod, sig: int = signal.SIGKILL, *, wait: bool = False) -> None:
        """Send sig to the pod's container (as the kubelet would: SIGKILL kills it at once)."""
        if pod.proc is None or pod.proc.poll() is not None:
            return
        pid = pod.container_pid()
        deadline = time.monotonic() + 20
        while pid is None and sig == signal.SIGTERM and pod.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a pod still being set up: its container gets the signal once it runs
            pid = pod.container_pid()
        if pid is not None:
            os.kill(pid, sig)
        elif sig == signal.SIGKILL:
            pod.proc.kill()
        self._event(f"{pod.dc}: sent {signal.Signals(sig).name} to pod {pod.name}")
        if wait:
            pod.proc.wait(30)

    def delete(self, pod: Pod, *, disruption: bool = False, reason: str = "deleted") -> None:
        """End ``pod`` as the kubelet ends a deleted pod: SIGTERM now, SIGKILL when its
        ``terminationGracePeriodSeconds`` (scaled by ``time_scale``, at least ``min_grace_s``) ends
        (``tick`` sends it). ``disruption``: the pod gets the DisruptionTarget condition first (an
        eviction, a preemption, a taint's or the kubelet's node-pressure eviction; a plain ``kubectl
        delete pod`` does not). The Job controller then sees the pod's end like any other: its exit
        code and condition through the podFailurePolicy, a replacement once it is terminal
        (``podReplacementPolicy: Failed``)."""
        if pod.phase != "Running" or pod.kill_at is not None:
            return
        pod.disrupted = pod.disrupted or disruption
        pod.ended_by = reason
        pod.ready = False  # a terminating pod leaves its Services' endpoints at once
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        pod.kill_at = time.monotonic() + max(grace * self.time_scale, self.min_grace_s)
        self._event(f"{pod.dc}: {reason} pod {pod.name}{' (DisruptionTarget)' if pod.disrupted else ''}: "
                    f"SIGTERM, SIGKILL in {pod.kill_at - time.monotonic():.1f}s (grace {grace:g}s scaled)")
        self.kill(pod, signal.SIGTERM)
        self._refresh_network()

    def evict(self, pod: Pod, *, wait: bool = True, timeout_s: float = 60.0) -> tuple[bool, str]:
        """A drain's eviction of ``pod`` (the eviction API): refused when a PodDisruptionBudget forbids
        it; otherwise ``delete`` with the DisruptionTarget condition; ``wait``: until the pod ended."""
        budgets = [o for o in self.rendered[pod.dc] if o["kind"] == "PodDisruptionBudget"]
        healthy = [p.labels for p in self.running() if p.dc == pod.dc]
        ok, why = may_evict(pod.labels, pod.phase, budgets, healthy)
        if not ok or pod.phase != "Running":
            return ok, why
        self.delete(pod, disruption=True, reason="evicted")
        if wait:
            self.wait_for(f"evicted pod {pod.name} to end", lambda: pod.phase != "Running", timeout_s)
        return True, why

    def drain_blockers(self) -> list[str]:
        """The pods (of any Job/Deployment/StatefulSet) a drain could not evict now, with why."""
        out = []
        for pod in self.pods:
            if pod.owner.pods.get(pod.index) is not pod:
                continue  # replaced
            budgets = [o for o in self.rendered[pod.dc] if o["kind"] == "PodDisruptionBudget"]
            healthy = [p.labels for p in self.running() if p.dc == pod.dc]
            ok, why = may_evict(pod.labels, pod.phase, budgets, healthy)
            if not ok:
                out.append(f"{pod.name}: {why}")
        return out

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tick()
            if predicate():
                return
            time.sleep(0.2)
        self.dump_stacks()
        raise AssertionError(f"replay: timed out after {timeout_s:g}s waiting for {what}\n{self.report()}")

    def dump_stacks(self, settle_s: float = 2.0) -> None:
        """SIGUSR1 to every running pod's container: each diloco process writes its threads' stacks to
        its log (``diloco.runtime.ops.stack_dumps``; a worker pod's agent passes it on to its workers)."""
        running = self.running()
        for pod in running:
            self.kill(pod, signal.SIGUSR1)
        if running:
            time.sleep(settle_s)

    def exec_in(self, dc: str, *cmd: str, timeout_s: float = 20.0) -> subprocess.CompletedProcess:
        """Run a command as root in datacenter dc's monitoring pod's network namespace."""
        ns, _ = self.monitoring[dc]
        return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=timeout_s)

    def spawn_in(self, dc: str, *cmd: str, log: Path) -> subprocess.Popen:
        """Start a long-running process as root in dc's monitoring pod's network namespace (a
        Prometheus server); close() stops it."""
        ns, _ = self.monitoring[dc]
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._spawned.append(proc)
        return proc

    def report(self, tail: int = 25, running_tail: int = 150) -> str:
        """Events, then each pod's last ``tail`` log lines (``running_tail`` for a running pod: its
        stack dump, when ``dump_stacks`` asked for one)."""
        lines = ["events:", *self.events[-60:], "pods:"]
        for pod in self.pods:
            lines.append(f"  {pod.dc} {pod.name} {pod.phase} exit={pod.exit_code} restarts={pod.restarts} ip={pod.ip}")
            keep = running_tail if pod.phase == "Running" else tail
            lines += [f"    | {line}" for line in pod.log_text().splitlines()[-keep:]]
        return "\n".join(lines)

    # -- teardown ------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self._spawned:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pod in self.pods:
            if pod.proc is not None and pod.proc.poll() is None:
                init = _children(pod.proc.pid)
                for pid in init[:1]:  # the pod's PID 1: every process of the pod dies with it
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                pod.proc.kill()
        for pod in self.pods:
            if pod.proc is not None:
                try:
                    pod.proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
        self.net.close()
