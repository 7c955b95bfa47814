"""The manifest replay: deploy/kubernetes's overlays, run as a cluster would run them, on one machine.

``k8s_replay`` runs every pod of both datacenters' rendered overlays (the coordinator's Job, each
group's Indexed Job) as its manifest says: command and args, user, group and fsGroup, Secrets and
ConfigMaps as files with their modes, env, volumes (a PersistentVolumeClaim per group that outlives
the pods), each datacenter's pods in network namespaces with the addresses deploy/README.md
assumes, NetworkPolicies, dc-b's node firewall and sysctls, and the Jobs' podFailurePolicy and
backoff. The test then plays an operator's day: the job starts and trains; a drain cannot evict a
running rank; a killed worker pod is replaced and heals; losing every group's pods leads to a
resume from the checkpoint volumes; every worker pod ends Succeeded, the Jobs complete, and drains
are no longer blocked. Every pod's log is JSON, line by line, and shows progress.

What the replay changes, to fit two cores in about two to three minutes (``_scaled``): one node
per group, one CPU requested, a small model and 1,600 steps in job.toml. Everything else is as
rendered.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import warnings
from pathlib import Path

import pytest
from ops_helpers import DEPLOY, OVERLAYS, ROOT

import k8s_replay as kr
from k8s_network import Datacenter, run
from k8s_semantics import read_image

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

# The address plan of deploy/README.md ("Addresses the manifests assume")
DATACENTERS = {
    "dc-a": dict(pod_cidr="10.10.0.0/16", node_cidr="10.12.0.0/16", service_cidr="10.96.0.0/16",
                 lb_cidr="10.11.0.0/24"),
    "dc-b": dict(pod_cidr="10.20.0.0/16", node_cidr="10.21.0.0/16", service_cidr="10.97.0.0/16",
                 lb_cidr="10.22.0.0/24", node_ifname="eth1",
                 names={"coordinator.dc-a.example.net": "dc-a/diloco-coordinator-external@lb"}),
}
MONITORING = {"dc-a": "10.10.200.1", "dc-b": "10.20.200.1"}  # a Prometheus pod in each cluster's pod network
STEPS, EVERY = 1600, 100  # [train] steps and checkpoint_every in the replay


def _need_replay() -> None:
    if os.geteuid() != 0:
        pytest.skip("the replay needs root: network namespaces, mounts and a second user (uid 10001)")
    for tool, how in (("ip", "iproute2"), ("unshare", "util-linux"), ("setpriv", "util-linux"),
                      ("chroot", "coreutils"), ("nft", "apt-get install nftables"),
                      ("kubectl", "it ships kustomize: https://kubernetes.io/docs/tasks/tools/")):
        if shutil.which(tool) is None:
            pytest.skip(f"the replay needs {tool} on PATH ({how})")
    probe = subprocess.run(["unshare", "--net", "nft", "list", "ruleset"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"nftables does not work in a new network namespace here: {probe.stderr.strip()}")


def _scaled(rendered: dict[str, list[dict]], nodes: tuple[int, ...] = (1, 1), steps: int = STEPS,
            every: int = EVERY) -> dict[str, list[dict]]:
    """The rendered objects, with group g on ``nodes[g]`` nodes (pods) of one CPU and a small, short
    job (``steps``, a checkpoint every ``every``)."""
    out = json.loads(json.dumps(rendered))
    for objects in out.values():
        for obj in objects:
            if obj["kind"] == "Job" and obj["spec"]["template"]["metadata"]["labels"].get(
                    "app.kubernetes.io/component") == "worker":
                (container,) = obj["spec"]["template"]["spec"]["containers"]
                group = int(next(e["value"] for e in container["env"] if e["name"] == "DILOCO_GROUP_ID"))
                obj["spec"]["completions"] = obj["spec"]["parallelism"] = nodes[group]
                for e in container["env"]:
                    if e["name"] == "DILOCO_NODES":
                        e["value"] = str(nodes[group])
                container["resources"] = {"requests": {"cpu": "1", "memory": "2Gi"},
                                          "limits": {"cpu": "1", "memory": "2Gi"}}
            if obj["kind"] == "ConfigMap" and "job.toml" in obj.get("data", {}):
                job = tomllib.loads(obj["data"]["job.toml"])
                job["model"].update(n_layer=2, n_head=2, n_embd=64, block_size=64)
                job["data"].update(batch_size=16, eval_batches=2)
                job["inner"].update(warmup_steps=5)
                job["sync"].update(h=10)
                job["topology"].update(group_sizes=",".join(map(str, nodes)))
                # stop_grace: under the replayed grace period (60 s scaled, at least k8s_replay.MIN_GRACE_S)
                job["train"].update(steps=steps, log_every=50, checkpoint_every=every, stop_grace=6.0)
                obj["data"]["job.toml"] = _toml(job)
    return out


def _toml(doc: dict) -> str:
    lines = []
    for section, values in doc.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _secrets(tmp: Path) -> dict[str, dict[str, dict[str, bytes]]]:
    """The Secrets deploy/README.md says to create, in each datacenter: its group's own credentials
    (``diloco credentials``, as the README runs it), its certificate, and in datacenter A the job
    token for the coordinator (nowhere else) and the coordinator's certificate."""
    pki = tmp / "pki"
    subprocess.run([sys.executable, "-m", "transport.certs", str(pki), "--name", "dc-a", "--name", "dc-b",
                    "--name", "coordinator", "--san", "diloco-coordinator", "--san", "coordinator.dc-a.example.net"],
                   check=True, capture_output=True, timeout=60)
    token, secret = os.urandom(16).hex(), os.urandom(32).hex()
    creds = tmp / "credentials"
    subprocess.run([sys.executable, "-m", "diloco", "credentials", "--groups", "2", "--out", str(creds)],
                   env={**os.environ, "DILOCO_TOKEN": token, "DILOCO_SECRET": secret}, check=True,
                   capture_output=True, timeout=60)

    def group(g: int) -> dict[str, bytes]:  # kubectl create secret generic ... --from-file=creds/group-G
        return {f.name: f.read_bytes() for f in (creds / f"group-{g}").iterdir()}

    def tls(name: str) -> dict[str, bytes]:
        return {"tls.crt": (pki / f"{name}.pem").read_bytes(), "tls.key": (pki / f"{name}.key").read_bytes(),
                "ca.crt": (pki / "ca.pem").read_bytes()}

    return {"dc-a": {"diloco-coordinator-token": {"token": token.encode()}, "diloco-credentials-0": group(0),
                     "diloco-tls": tls("dc-a"), "diloco-coordinator-tls": tls("coordinator")},
            "dc-b": {"diloco-credentials-1": group(1), "diloco-tls": tls("dc-b")}}


def _node_setup(ns: str) -> None:
    """Datacenter B's documented node settings: its sysctl file and firewall."""
    for line in (DEPLOY / "kubernetes" / "overlays" / "dc-b" / "node-sysctl.conf").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = (x.strip() for x in line.split("=", 1))
            run("ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}")
    run("ip", "netns", "exec", ns, "nft", "-f", str(DEPLOY / "kubernetes" / "overlays" / "dc-b" / "node-firewall.nft"))


def _step_done(replay: kr.Replay, dc: str, claim: str, group: int, step: int) -> bool:
    return (replay.workdir / "pvcs" / dc / claim / f"step-{step:06d}" / f"group-{group}.json").exists()


def _newest(replay: kr.Replay, dc: str, claim: str, group: int) -> int:
    folder = replay.workdir / "pvcs" / dc / claim
    steps = [int(p.parent.name.split("-")[1]) for p in folder.glob(f"step-*/group-{group}.json")] if folder.exists() else []
    return max(steps, default=0)


def _common_since(replay: kr.Replay, claims: dict, since: float) -> int:
    """The newest step both groups wrote a checkpoint of after ``since`` (wall clock), or 0."""
    steps = []
    for g, (dc, claim) in claims.items():
        folder = replay.workdir / "pvcs" / dc / claim
        steps.append({int(p.parent.name.split("-")[1]) for p in folder.glob(f"step-*/group-{g}.json")
                      if p.stat().st_mtime >= since} if folder.exists() else set())
    common = set.intersection(*steps)
    return max(common, default=0)


def _fetch(replay: kr.Replay, dc: str, url: str, timeout_s: float = 10.0) -> int:
    """HTTP status of GET url from datacenter dc's monitoring pod (0: no connection within timeout_s)."""
    code = ("import sys, urllib.request\ntry:\n    print(urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).status)\n"
            "except Exception as e:\n    print(getattr(e, 'code', 0)); print(repr(e), file=sys.stderr)")
    out = replay.exec_in(dc, sys.executable, "-c", code, url, str(timeout_s), timeout_s=timeout_s + 20)
    if out.stderr.strip():
        print(f"fetch {url} from {dc}: {out.stderr.strip()[-500:]}")
    return int(out.stdout.strip() or 0)


def _assert_own_credentials(r: kr.Replay) -> None:
    """Every running worker pod's process holds its own group's credential and keys, and neither the
    job token nor another group's credential; the coordinator's holds the job token."""
    from diloco.coordinator.credentials import group_token
    from transport.identity import GroupKeys

    token = r.secrets["dc-a"]["diloco-coordinator-token"]["token"].decode()
    checked = set()
    for pod in r.running():
        pid = pod.container_pid()
        if pid is None:
            continue
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        if pod.owner.name == "diloco-coordinator":
            assert env["DILOCO_TOKEN"] == token
            checked.add("coordinator")
            continue
        g = int(env["DILOCO_GROUP_ID"])
        assert token not in raw, f"worker pod {pod.name} holds the job token"
        assert env["DILOCO_TOKEN"] == group_token(token, g), pod.name
        keys = GroupKeys.from_text(env["DILOCO_SECRET"])
        assert keys.group == g and keys.peers == [0, 1], pod.name
        checked.add(g)
    assert checked == {"coordinator", 0, 1}, checked


def _meta(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def _discovery(r: kr.Replay, dc: str, path: Path) -> None:
    """What Kubernetes' pod discovery would give dc's Prometheus now: one target per container
    port of each running pod, with the pod's labels and annotations as meta labels."""
    groups = []
    for pod in r.running():
        if pod.dc != dc:
            continue
        meta = {"__meta_kubernetes_namespace": pod.owner.obj["metadata"].get("namespace", "default"),
                "__meta_kubernetes_pod_name": pod.name, "__meta_kubernetes_pod_phase": "Running"}
        meta.update({f"__meta_kubernetes_pod_label_{_meta(k)}": v for k, v in pod.labels.items()})
        meta.update({f"__meta_kubernetes_pod_annotation_{_meta(k)}": v for k, v in pod.annotations.items()})
        for c in pod.spec["containers"]:
            for port in c.get("ports", []):
                groups.append({"targets": [f"{pod.ip}:{port['containerPort']}"], "labels": {
                    **meta, "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])}})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)  # Prometheus re-reads the file on change


def _start_prometheus(r: kr.Replay, workdir: Path) -> dict[str, str]:
    """Each datacenter's Prometheus, as deploy/prometheus/prometheus-DC.yml configures it (pod
    discovery from ``_discovery``; B's federation of A's Prometheus at its monitoring pod's
    address), in its monitoring pod's network namespace. Returns {dc: base URL}."""
    import yaml

    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not on PATH (Debian: apt-get install prometheus; .ci/run does)")
    urls = {}
    for dc in DATACENTERS:
        config = yaml.safe_load((DEPLOY / "prometheus" / f"prometheus-{dc}.yml").read_text())
        config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "2s"
        config["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in config["rule_files"]]
        sd = workdir / f"sd-{dc}.json"
        for job in config["scrape_configs"]:
            job.pop("scrape_interval", None)
            if "kubernetes_sd_configs" in job:
                del job["kubernetes_sd_configs"]
                job["file_sd_configs"] = [{"files": [str(sd)]}]
            if job.get("metrics_path") == "/federate":  # A's Prometheus: its monitoring pod's address
                job["static_configs"] = [{"targets": [f"{MONITORING['dc-a']}:9090"]}]
        r.on_change.append(lambda replay, dc=dc, sd=sd: _discovery(replay, dc, sd))
        _discovery(r, dc, sd)
        (workdir / f"prometheus-{dc}.yml").write_text(json.dumps(config))
        r.spawn_in(dc, prometheus, f"--config.file={workdir / f'prometheus-{dc}.yml'}",
                   f"--storage.tsdb.path={workdir / f'tsdb-{dc}'}", "--web.listen-address=0.0.0.0:9090",
                   "--log.level=warn", log=workdir / f"prometheus-{dc}.log")
        urls[dc] = f"http://{MONITORING[dc]}:9090"
    return urls


def _query(r: kr.Replay, dc: str, url: str, expr: str) -> list[dict] | None:
    """The result of an instant query to dc's Prometheus, None when it cannot answer (yet)."""
    code = ("import json, sys, urllib.parse, urllib.request\n"
            "u = sys.argv[1] + '/api/v1/query?' + urllib.parse.urlencode({'query': sys.argv[2]})\n"
            "print(json.dumps(json.loads(urllib.request.urlopen(u, timeout=5).read())['data']['result']))")
    out = r.exec_in(dc, sys.executable, "-c", code, url, expr)
    return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else None


def _make_replay(tmp_path: Path, rendered: dict[str, list[dict]], plans: dict[str, dict], node_setup: dict,
                 scaled: dict | None = None, **options):
    _need_replay()
    workdir = tmp_path / "replay"
    workdir.mkdir()
    datacenters = {name: Datacenter(name, **plan) for name, plan in plans.items()}
    assert set(datacenters) == {o.name for o in OVERLAYS}, "the replay's address plan names every overlay"
    return kr.Replay(workdir, datacenters, _scaled(rendered, **(scaled or {})), secrets=_secrets(tmp_path),
                     image=read_image(ROOT / "Dockerfile", "cpu"), repo=ROOT, monitoring=MONITORING,
                     node_setup=node_setup, **options)


@pytest.fixture
def replay(tmp_path: Path, rendered):
    r = _make_replay(tmp_path, rendered, DATACENTERS, {"dc-b": _node_setup})
    try:
        yield r
    finally:
        r.close()
        shutil.rmtree(r.workdir, ignore_errors=True)  # files of uid 10001 included


def _render(path: Path) -> list[dict]:
    import yaml

    text = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60,
                          check=True).stdout
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture
def replay_per_rank_lb(tmp_path: Path, rendered):
    """dc-a as shipped; dc-b as examples/dc-b-per-rank-lb: pods not routed to A (they leave through
    the nodes' NAT, 10.21.0.1), each rank behind its load balancer, advertised by name."""
    lb = _render(DEPLOY / "kubernetes" / "examples" / "dc-b-per-rank-lb")
    # The replay's Services forward only to ready pods, as kube-proxy and a cloud balancer's health
    # checks do; a rank is ready once it joined, which needs its balancer: without
    # publishNotReadyAddresses the per-rank balancers wait for a readiness that waits for them (the
    # ranks give up after [transport] timeout_s and restart, for ever). Until the example sets it,
    # the replay sets it, and says so.
    for s in lb:
        if s["kind"] == "Service" and s["spec"].get("type") == "LoadBalancer" and s["metadata"]["name"].startswith(
                "diloco-group") and not s["spec"].get("publishNotReadyAddresses"):
            warnings.warn(f"examples/dc-b-per-rank-lb: Service {s['metadata']['name']} lacks publishNotReadyAddresses: "
                          "true (a rank is ready only after it joined through its balancer); the replay adds it")
            s["spec"]["publishNotReadyAddresses"] = True
    names = {s["metadata"]["annotations"]["external-dns.alpha.kubernetes.io/hostname"]: f"dc-b/{s['metadata']['name']}@lb"
             for s in lb if s["kind"] == "Service" and s["spec"].get("type") == "LoadBalancer"}
    plans = json.loads(json.dumps(DATACENTERS))
    plans["dc-a"]["names"] = names  # what A's DNS answers for B's balancers
    plans["dc-b"]["pod_egress"] = "10.21.0.1"
    r = _make_replay(tmp_path, {"dc-a": rendered["dc-a"], "dc-b": lb}, plans, {})
    try:
        yield r
    finally:
        r.close()
        shutil.rmtree(r.workdir, ignore_errors=True)


def test_replayed_ranks_behind_per_rank_load_balancers_train(replay_per_rank_lb):
    """The third network model: B's ranks are reachable only through their load balancers, by the
    names they advertise; the job trains (both groups checkpoint after exchanging)."""
    r = replay_per_rank_lb
    coordinator = r.workload("diloco-coordinator", "dc-a")
    groups = {0: r.workload("diloco-group-0", "dc-a"), 1: r.workload("diloco-group-1", "dc-b")}
    claims = {0: ("dc-a", "diloco-checkpoints-0"), 1: ("dc-b", "diloco-checkpoints-1")}
    r.start()
    r.wait_for("the first checkpoint of both groups",
               lambda: all(_step_done(r, *claims[g], g, EVERY) for g in groups)
               or coordinator.status == "Failed" or any(w.status == "Failed" for w in groups.values()), 150)
    assert coordinator.status == "Running" and all(w.status == "Running" for w in groups.values()), r.report()
    _assert_own_credentials(r)
    b_pod = groups[1].pods[0]
    # B's pod itself is not reachable from A (only through its balancer)
    assert _fetch(r, "dc-a", f"http://{b_pod.ip}:9300/metrics", 3) == 0, "dc-b's pods must not be routed to A"
    token = r.secrets["dc-a"]["diloco-coordinator-token"]["token"].decode()
    code = ("import json, sys, urllib.request\n"
            "req = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer ' + sys.argv[2]})\n"
            "print(urllib.request.urlopen(req, timeout=10).read().decode())")
    out = r.exec_in("dc-a", sys.executable, "-c", code, f"http://{coordinator.pods[0].ip}:9400/status", token)
    status = json.loads(out.stdout)
    addresses = {g["group"]: [m["address"] for m in g["ranks"]] for g in status["groups"]}
    assert addresses[1] == ["diloco-group-1-0.dc-b.example.net:29500"], addresses
    assert addresses[0][0].endswith(":29500") and addresses[0][0].startswith("10.10."), addresses


def test_replayed_job_trains_survives_a_killed_pod_and_the_loss_of_every_group_and_completes(replay):
    r = replay
    coordinator = r.workload("diloco-coordinator", "dc-a")
    groups = {0: r.workload("diloco-group-0", "dc-a"), 1: r.workload("diloco-group-1", "dc-b")}
    claims = {0: ("dc-a", "diloco-checkpoints-0"), 1: ("dc-b", "diloco-checkpoints-1")}
    t0 = time.monotonic()
    r.start()
    prometheus = _start_prometheus(r, r.workdir)

    # 1. the job starts and trains: both groups write their first checkpoint to their volume
    r.wait_for("the first checkpoint of both groups",
               lambda: all(_step_done(r, *claims[g], g, EVERY) for g in groups)
               or coordinator.status == "Failed" or any(w.status == "Failed" for w in groups.values()), 150)
    assert coordinator.status == "Running" and all(w.status == "Running" for w in groups.values()), r.report()
    _assert_own_credentials(r)  # each pod as the kubelet started it: its own group's Secret, no job token

    # every local rank's metrics port answers the monitoring namespace; the other datacenter gets nothing
    for g, w in groups.items():
        pod = w.pods[0]
        ports = [p["containerPort"] for p in pod.spec["containers"][0]["ports"] if p["name"].startswith("metrics-")]
        assert ports, "each local rank's metrics port is declared"
        for port in ports:
            assert _fetch(r, pod.dc, f"http://{pod.ip}:{port}/metrics") == 200, f"group {g} :{port}\n{r.report()}"
    a_pod = groups[0].pods[0]
    assert _fetch(r, "dc-b", f"http://{a_pod.ip}:9300/metrics", 3) == 0, "dc-a's NetworkPolicy admits metrics from dc-b"
    coord = coordinator.pods[0]
    assert _fetch(r, "dc-a", f"http://{coord.ip}:9400/healthz") == 200, r.report()

    # each datacenter's Prometheus, configured as shipped, scrapes every rank of its own pods, A the
    # coordinator too, and B sees the coordinator's series (its `up` included) by federation from A
    for dc in DATACENTERS:
        want = {"diloco-worker": sum(1 for p in r.running() if p.dc == dc and p.owner.name.startswith("diloco-group")
                                     for port in p.spec["containers"][0]["ports"] if port["name"].startswith("metrics-")),
                "diloco-coordinator": 1}
        def scraped(dc=dc, want=want):
            up = _query(r, dc, prometheus[dc], 'up{job=~"diloco-worker|diloco-coordinator"} == 1')
            got = {}
            for series in up or []:
                got[series["metric"]["job"]] = got.get(series["metric"]["job"], 0) + 1
            return got == want
        r.wait_for(f"{dc}'s Prometheus scraping every rank", scraped, 60)
    r.wait_for("dc-b's Prometheus seeing the coordinator (federation)", lambda: _query(
        r, "dc-b", prometheus["dc-b"], 'diloco_coordinator_quorum_complete{job="diloco-coordinator"} == 1'), 60)
    # the absent() alerts' expressions, as each datacenter loads them, find nothing while the job runs
    import yaml

    for dc in DATACENTERS:
        config = yaml.safe_load((DEPLOY / "prometheus" / f"prometheus-{dc}.yml").read_text())
        exprs = [rule["expr"] for f in config["rule_files"]
                 for g in yaml.safe_load((DEPLOY / "prometheus" / f).read_text())["groups"] for rule in g["rules"]
                 if rule.get("alert") in ("DilocoCoordinatorAbsent", "DilocoGroupAbsent")]
        assert len(exprs) == 2, f"{dc}: the coordinator's and its group's absent() alerts"
        for expr in exprs:
            r.wait_for(f"{dc}: {expr} to be empty", lambda dc=dc, expr=expr: _query(r, dc, prometheus[dc], expr) == [],
                       30)

    # a drain cannot evict a running rank or the coordinator
    blockers = r.drain_blockers()
    assert any("diloco-group-0" in b for b in blockers) and any("diloco-coordinator" in b for b in blockers), blockers

    # 2. a killed worker pod is replaced (counted against backoffLimit) and heals from the other group
    killed = groups[1].pods[0]
    r.kill(killed, signal.SIGKILL)
    r.wait_for("group 1's replacement pod", lambda: groups[1].pods[0] is not killed
               and groups[1].pods[0].phase == "Running", 60)
    assert groups[1].history[-1]["exit_code"] == 137 and groups[1].failures == 1
    healer = groups[1].pods[0]
    r.wait_for("group 1 to heal", lambda: "healed from group 0" in healer.log_text() or healer.phase != "Running", 90)
    assert healer.phase == "Running", r.report()
    healed_at = time.time()

    # 3. every group lost at once: the new pods resume from their checkpoint volumes
    r.wait_for("a checkpoint both groups wrote after the heal", lambda: _common_since(r, claims, healed_at)
               or healer.phase != "Running", 120)
    resumable = _common_since(r, claims, healed_at)
    lost = [w.pods[0] for w in groups.values()]
    for pod in lost:
        r.kill(pod, signal.SIGKILL)
    r.wait_for("both groups' replacement pods", lambda: all(w.pods[0] not in lost and w.pods[0].phase != "Pending"
                                                            for w in groups.values()), 60)

    # 4. the job finishes: every worker pod Succeeded, both Jobs and the coordinator's complete
    r.wait_for("the Jobs to finish", lambda: all(w.status != "Running" for w in [coordinator, *groups.values()]), 180)
    assert coordinator.status == "Complete" and all(w.status == "Complete" for w in groups.values()), r.report()
    for w in groups.values():
        assert all(p.phase == "Succeeded" for p in w.pods.values()), r.report()
    for g, w in groups.items():
        log = w.pods[0].log_text()
        assert f"resumed from" in log and f"step-{resumable:06d}" in log, f"group {g} did not resume:\n{r.report()}"
    assert r.drain_blockers() == [], "finished pods must not block drains"

    # logs: JSON on every line of every pod, progress lines while training, the coordinator's summary
    for pod in r.pods:
        for line in pod.log_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                pytest.fail(f"{pod.name}: a line that is not JSON: {line!r}")
            assert {"ts", "level", "msg"} <= set(record), line
    progress = [json.loads(line) for line in groups[0].pods[0].log_text().splitlines() if '"progress"' in line]
    assert progress, "workers print progress lines"
    assert any("summary" in json.loads(line).get("msg", "") for line in coordinator.pods[0].log_text().splitlines())
    print(f"replay: {time.monotonic() - t0:.1f} s\n" + "\n".join(r.events))
