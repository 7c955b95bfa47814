"""deploy/kubernetes: every overlay renders, validates strictly, and is wired to what the code accepts.

The wiring tests read ``diloco worker --help``, ``diloco coordinator --help`` and ``torchrun --help``
at run time, so a flag renamed in the code fails here until the manifests follow. What the objects
do when they run is replayed by test_ops_replay.py.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
import sys

import pytest
import tomllib
from ops_helpers import ADDRESSES, DEPLOY, OVERLAYS

from diloco.job import config as config_mod
from diloco.job import config_parse
from diloco.runtime.ops import exit_codes
from diloco.runtime.rank.endpoint import SECRET_ENV, TOKEN_ENV

KUBERNETES = DEPLOY / "kubernetes"


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


def _component(obj: dict) -> str | None:
    return obj.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component")


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
    """(the group's Job, its container, torchrun's args, diloco worker's args)."""
    (job,) = [o for o in objects if o["kind"] == "Job" and _component(o) == "worker"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    argv = container["command"] + container["args"]
    assert argv[:2] == ["diloco", "torchrun"], "the group runs `diloco torchrun` (torchrun keeping the exit codes)"
    i = argv.index("-m")
    assert argv[i + 1: i + 3] == ["diloco", "worker"], "... -m diloco worker"
    return job, container, argv[2:i], argv[i + 3:]


def _job_toml(objects: list[dict]) -> dict:
    """The TOML the worker's --config points at, read from the rendered ConfigMap it mounts."""
    job, container, _, worker_args = _worker(objects)
    spec = job["spec"]["template"]["spec"]
    path = _flags(worker_args)["--config"]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    cm = _one(objects, "ConfigMap", volume["configMap"]["name"])
    return tomllib.loads(cm["data"][path[len(mount["mountPath"]):].lstrip("/")])


def _senders(objects: list[dict], dc: str) -> str:
    """The address block a datacenter's ranks send from: nodes with hostNetwork, else pods."""
    job, _, _, _ = _worker(objects)
    return ADDRESSES[dc]["nodes" if job["spec"]["template"]["spec"].get("hostNetwork") else "pods"]


def _pod_specs(objects: list[dict]):
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec")
        if spec is not None:
            yield obj, spec


def test_every_overlay_renders_a_finite_group_and_one_hosts_the_coordinator(rendered):
    assert len(rendered) >= 2, f"need an overlay per datacenter, found {list(rendered)}"
    with_coordinator = []
    for name, objects in rendered.items():
        kinds = {o["kind"] for o in objects}
        assert {"Job", "Service", "ConfigMap", "PodDisruptionBudget", "PersistentVolumeClaim"} <= kinds, name
        assert not kinds & {"StatefulSet", "Deployment"}, f"{name}: a finished job must not be restarted forever"
        job, container, _, _ = _worker(objects)
        service = _one(objects, "Service", job["metadata"]["name"])
        pod = job["spec"]["template"]["spec"]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        assert pod["subdomain"] == service["metadata"]["name"], f"{name}: pods are GROUP-i.GROUP for the rendezvous"
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        if any(_component(o) == "coordinator" for o in objects):
            with_coordinator.append(name)
    assert len(with_coordinator) == 1, f"exactly one datacenter hosts the coordinator: {with_coordinator}"


def test_jobs_tell_done_restart_me_and_configuration_errors_apart(rendered):
    """What each Job does with each exit code of diloco/runtime/ops/exit_codes.py, read through the
    podFailurePolicy as the Job controller reads it (first matching rule; k8s_semantics)."""
    import k8s_semantics as ks

    signalled = {"SIGTERM": 128 + 15, "SIGKILL": 128 + 9}
    for name, objects in rendered.items():
        for job in (o for o in objects if o["kind"] == "Job"):
            spec, pod = job["spec"], job["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            assert pod["restartPolicy"] == "Never", "podFailurePolicy needs restartPolicy Never"
            assert spec["podReplacementPolicy"] == "Failed", "the only value a podFailurePolicy allows"
            assert 0 < spec["ttlSecondsAfterFinished"]
            for rule in spec["podFailurePolicy"]["rules"]:
                codes = rule.get("onExitCodes")
                if codes:
                    assert codes["containerName"] == container["name"] and codes["operator"] == "In"
                    assert exit_codes.DONE not in codes["values"]

            def action(code: int, disrupted: bool = False) -> str:
                return ks.failure_action(job, container["name"], code, disrupted)  # noqa: B023

            what = f"{name}: {job['metadata']['name']}"
            assert action(exit_codes.CONFIGURATION) == "FailJob", f"{what}: a configuration error must fail the Job"
            assert action(exit_codes.RESTART) == "Ignore", f"{what}: 'restart me' restarts without counting"
            assert action(signalled["SIGTERM"]) == "Ignore", \
                f"{what}: SIGTERM (kubectl delete pod: no DisruptionTarget) is not the pod's fault"
            assert action(signalled["SIGKILL"]) == "Count", f"{what}: out of memory must not restart for ever"
            assert action(signalled["SIGKILL"], disrupted=True) == "Ignore", "evictions restart without counting"
            assert action(exit_codes.CONFIGURATION, disrupted=True) == "FailJob", "a configuration error still fails"
            if _component(job) == "worker":
                env = _env(container)
                nodes = int(env["DILOCO_NODES"]["value"])
                assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
                assert action(exit_codes.OTHER) == "Count", f"{what}: an error restarts, counted"
            else:
                assert spec.get("completions", 1) == 1 and spec.get("parallelism", 1) == 1, "one coordinator"
                assert "--keep-running" not in container["args"], "the coordinator must end with the job"
                assert action(exit_codes.OTHER) == "FailJob", f"{what}: 1 is a failed job (groups diverged)"
                assert 0 < spec["backoffLimit"] <= 10


def test_one_nodes_failures_never_spend_another_nodes_budget(rendered):
    """A group's pods each have a budget of their own (backoffLimitPerIndex): with a Job-wide
    backoffLimit, one node failing again and again, or one incident that fails several pods,
    would fail the group for the others' faults. One node out of budget fails the group (it cannot
    train without it: maxFailedIndexes 0)."""
    for name, objects in rendered.items():
        job, _, _, _ = _worker(objects)
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed" and 0 < spec["backoffLimitPerIndex"] <= 10, name
        assert spec["maxFailedIndexes"] == 0, f"{name}: a group missing a node would wait for it for ever"
        assert "backoffLimit" not in spec, \
            f"{name}: a Job-wide backoffLimit ({spec.get('backoffLimit')}) counts every node's failures together"


def test_budgets_hold_running_pods_only_and_never_block_a_drain_after_completion(rendered):
    import k8s_semantics as ks

    for name, objects in rendered.items():
        budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
        for workload in (o for o in objects if o["kind"] == "Job"):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            mine = [b for b in budgets if ks.selects(b["spec"]["selector"], labels)]
            assert len(mine) == 1, f"{name}: {workload['metadata']['name']} needs exactly one budget"
            assert mine[0]["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow"
            assert ks.may_evict(labels, "Running", mine, [labels])[0] is False, "a running rank is held"
            assert ks.may_evict(labels, "Succeeded", mine, [])[0], "a finished one is not"
            assert ks.may_evict(labels, "Pending", mine, [])[0], "nor one that never ran"


def test_both_datacenters_fit_one_namespace(rendered):
    """The one-cluster variant (two node pools): applying both overlays to one namespace replaces
    nothing: every object either has a name of its own or is the same object."""
    seen: dict[tuple[str, str, str], tuple[str, dict]] = {}
    for name, objects in rendered.items():
        for obj in objects:
            key = (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
            if key in seen:
                other, first = seen[key]
                strip = lambda o: {**o, "metadata": {**o["metadata"], "labels": {  # noqa: E731
                    k: v for k, v in o["metadata"].get("labels", {}).items() if k != "diloco.dev/datacenter"}}}
                assert strip(first) == strip(obj), f"{key} differs between {other} and {name}: one would replace the other"
            else:
                seen[key] = (name, obj)
    names = {o["metadata"]["name"] for objects in rendered.values() for o in objects if o["kind"] == "Job"}
    assert len(names) == sum(1 for objects in rendered.values() for o in objects if o["kind"] == "Job")


def test_overlays_differ_in_nic_count_and_link_settings(rendered):
    nics, links = {}, {}
    for name, objects in rendered.items():
        job, container, _, worker_args = _worker(objects)
        nics[name] = job["spec"]["completions"] * int(_env(container)["DILOCO_RANKS_PER_NODE"]["value"])
        links[name] = {k: v for k, v in _flags(worker_args).items() if k in ("--connections", "--timeout")}
    assert len(set(nics.values())) > 1, f"overlays should differ in NIC (rank) count: {nics}"
    assert len({tuple(sorted(v.items())) for v in links.values()}) > 1, f"and in link settings: {links}"


def test_worker_command_line_matches_what_torchrun_and_diloco_worker_accept(rendered, help_flags):
    for name, objects in rendered.items():
        job, container, torchrun_args, worker_args = _worker(objects)
        unknown = set(_flags(torchrun_args)) - help_flags["torchrun"]
        assert not unknown, f"{name}: torchrun does not accept {unknown}"
        unknown = set(_flags(worker_args)) - help_flags["worker"]
        assert not unknown, f"{name}: diloco worker does not accept {unknown}"
        env = _env(container)
        for ref in re.findall(r"\$\((\w+)\)", " ".join(container["args"])):
            assert ref in env, f"{name}: $({ref}) in the args is not defined in the container's env"
        t = _flags(torchrun_args)
        assert env["DILOCO_NODES"]["value"] == str(job["spec"]["completions"]), \
            f"{name}: torchrun --nnodes must equal the Job's completions"
        assert t["--master-addr"] == "$(JOB_NAME)-0.$(JOB_NAME)" and env["JOB_NAME"]["valueFrom"]["fieldRef"][
            "fieldPath"] == "metadata.labels['batch.kubernetes.io/job-name']", "the rendezvous is pod 0's stable name"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(t["--master-port"]) == ports["rendezvous"] and t["--max-restarts"] == "0"
        assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.annotations['batch.kubernetes.io/job-completion-index']" and t["--node-rank"] == "$(POD_INDEX)"
        w = _flags(worker_args)
        assert w["--host"] == "$(POD_IP)" and env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        ranks = int(env["DILOCO_RANKS_PER_NODE"]["value"])
        metrics = {n: p for n, p in ports.items() if n.startswith("metrics")}
        assert metrics == {f"metrics-{i}": int(w["--metrics-port"]) + i for i in range(ranks)}, \
            f"{name}: every local rank's metrics port (--metrics-port + local rank) is declared"
        annotations = job["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and "prometheus.io/port" not in annotations, \
            "one annotated port would leave the other ranks unscraped"
        assert w["--log-format"] in config_mod.LOG_FORMATS
        assert env["GLOO_SOCKET_IFNAME"]["value"], "Gloo must not guess its interface from the host name"
        cpu = env["DILOCO_CPU_REQUEST"]["valueFrom"]["resourceFieldRef"]
        assert cpu["resource"] == "requests.cpu" and cpu["containerName"] == container["name"]
        assert "OMP_NUM_THREADS" not in env and "--threads-per-rank" not in w, "threads follow the CPU request"


def test_coordinator_command_line_matches_diloco_coordinator_and_the_job(rendered, help_flags):
    (objects,) = [o for o in rendered.values() if any(_component(x) == "coordinator" for x in o)]
    (job,) = [o for o in objects if o["kind"] == "Job" and _component(o) == "coordinator"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert "command" not in container and container["args"][0] == "coordinator", "the image's entrypoint is diloco"
    flags = _flags(container["args"][1:])
    unknown = set(flags) - help_flags["coordinator"]
    assert not unknown, f"diloco coordinator does not accept {unknown}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(flags["--port"]) == ports["grpc"] and int(flags["--metrics-port"]) == ports["metrics"]
    assert container["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" and "readinessProbe" in container
    service = _one(objects, "Service", "diloco-coordinator")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    for name, group_objects in rendered.items():  # every group dials a coordinator port that exists
        _, worker_container, _, _ = _worker(group_objects)
        address = _env(worker_container)["DILOCO_COORDINATOR"]["value"]
        assert address.rsplit(":", 1)[1] == flags["--port"], f"{name} dials {address}"
        assert _job_toml(group_objects)["topology"]["groups"] == int(flags["--groups"]), f"{name}: groups differ"


def test_the_coordinators_probes_tolerate_a_loaded_coordinator(rendered):
    """A probe that kills a slow coordinator stalls every group (and, restarted too often, ends the
    job): a startup probe holds the others until it first answers, every probe waits seconds for an
    answer, liveness gives up only after half a minute or more of silence, and the CPU it may burst
    into is above what it requests (a throttled process answers late)."""
    (objects,) = [o for o in rendered.values() if any(_component(x) == "coordinator" for x in o)]
    (job,) = [o for o in objects if o["kind"] == "Job" and _component(o) == "coordinator"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    startup, liveness, readiness = (container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe"))
    assert startup["httpGet"] == liveness["httpGet"], "the startup probe asks what liveness asks"
    for name, probe in (("startup", startup), ("liveness", liveness), ("readiness", readiness)):
        assert probe.get("timeoutSeconds", 1) >= 5, f"{name}: {probe.get('timeoutSeconds', 1)} s to answer"
    assert liveness.get("periodSeconds", 10) * liveness.get("failureThreshold", 3) >= 30
    assert startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) >= 30
    import k8s_semantics as ks

    resources = container["resources"]
    assert ks.quantity(resources["requests"]["cpu"]) >= 1
    assert ks.quantity(resources["limits"]["cpu"]) > ks.quantity(resources["requests"]["cpu"])
    assert resources["limits"]["memory"] == resources["requests"]["memory"]


def test_job_config_loads_checkpoints_to_each_groups_volume_and_every_group_matches_its_size(rendered):
    group_ids = []
    for name, objects in rendered.items():
        job, container, _, _ = _worker(objects)
        toml = _job_toml(objects)
        cfg = config_parse.from_dict(toml).validate()
        env = _env(container)
        group = int(env["DILOCO_GROUP_ID"]["value"])
        group_ids.append(group)
        ranks = job["spec"]["completions"] * int(env["DILOCO_RANKS_PER_NODE"]["value"])
        assert cfg.topology.sizes()[group] == ranks, \
            f"{name}: group {group} has {ranks} ranks but the job config gives {cfg.topology.sizes()[group]}"
        # checkpoints on, into a PersistentVolumeClaim of this group's
        assert cfg.train.checkpoint_every > 0 and cfg.train.checkpoint_dir, f"{name}: job checkpoints are off"
        pod = job["spec"]["template"]["spec"]
        mount = next(m for m in container["volumeMounts"]
                     if (cfg.train.checkpoint_dir + "/").startswith(m["mountPath"].rstrip("/") + "/"))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert "persistentVolumeClaim" in volume, f"{name}: checkpoints on {sorted(volume)} die with the pod"
        claim = _one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        if job["spec"]["completions"] > 1:
            assert "ReadWriteMany" in claim["spec"]["accessModes"], f"{name}: the group's nodes share the volume"
        assert not mount.get("readOnly")
    assert sorted(group_ids) == list(range(len(group_ids))), f"each overlay must be another group: {group_ids}"
    tomls = {name: _job_toml(o) for name, o in rendered.items()}
    assert len({repr(sorted(t.items())) for t in tomls.values()}) == 1, "every group must get the same job config"


def test_secrets_come_only_from_secrets_and_their_files_are_readable_by_the_pod(rendered):
    for name, objects in rendered.items():
        for obj in objects:
            assert obj["kind"] != "Secret", f"{name}: a Secret in the manifests would put its value in git"
        for obj, spec in _pod_specs(objects):
            (container,) = spec["containers"]
            env = _env(container)
            for var in (SECRET_ENV, TOKEN_ENV):
                if var in env:
                    assert "secretKeyRef" in env[var].get("valueFrom", {}), f"{name}: {var} must come from a Secret"
            text = " ".join(container.get("args", []) + container.get("command", [])).lower()
            assert "secret" not in text and "token" not in text, f"{name}: credentials in the command line"
            tls_args = {k: v for k, v in _flags(container.get("args", [])).items() if k.startswith("--tls-")}
            ctx = spec["securityContext"]
            for flag, path in tls_args.items():
                mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
                volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
                assert "secret" in volume, f"{name}: {flag} must be read from a Secret volume"
                # the kubelet writes the files as root; the user reads them through fsGroup, or not at all
                mode = volume["secret"].get("defaultMode", 0o644)
                readable = mode & 0o004 or (mode & 0o040 and "fsGroup" in ctx) or ctx.get("runAsUser") == 0
                assert readable, (f"{name}: {obj['metadata']['name']} runs as {ctx.get('runAsUser')} without fsGroup: "
                                  f"it cannot read {path} (mode {mode:o}, owned by root)")
                assert not mode & 0o004, f"{name}: {path} must not be world-readable"
            assert set(tls_args) == {"--tls-cert", "--tls-key", "--tls-ca"}, f"{name}: {obj['kind']} needs mTLS"
            assert "--insecure-coordinator" not in container.get("args", [])


def test_pods_are_bounded_and_unprivileged(rendered):
    for name, objects in rendered.items():
        for obj, spec in _pod_specs(objects):
            assert spec["securityContext"]["runAsNonRoot"] and spec["automountServiceAccountToken"] is False
            for c in spec["containers"]:
                assert set(c["resources"]["requests"]) >= {"cpu", "memory"} <= set(c["resources"]["limits"]), \
                    f"{name}: {c['name']} needs requests and limits"
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
                assert c["securityContext"]["readOnlyRootFilesystem"] is True
                assert ":" in c["image"] and not c["image"].endswith(":latest")


def _admitted(policy: dict) -> list[tuple[list, set]]:
    """[(sources, {(port, endPort)})] of each ingress rule."""
    return [(rule.get("from", []), {(p["port"], p.get("endPort")) for p in rule.get("ports", [])})
            for rule in policy["spec"]["ingress"]]


def test_network_policies_and_node_firewalls_follow_each_datacenters_network_model(rendered):
    """A routed pod network: a NetworkPolicy admits the other datacenters from where their ranks
    send (their pod block, or their node block when they use the host network). The host network:
    NetworkPolicies would do nothing, so none is made and the overlay ships a node firewall."""
    import k8s_semantics as ks

    others = {name: [(o, _senders(rendered[o], o)) for o in rendered if o != name] for name in rendered}
    for name, objects in rendered.items():
        job, container, _, worker_args = _worker(objects)
        pod = job["spec"]["template"]["spec"]
        ranks = int(_env(container)["DILOCO_RANKS_PER_NODE"]["value"])
        data = int(_flags(worker_args)["--data-port"])  # local rank i listens on data + i
        assert data > 0, f"{name}: a fixed data-plane port, so a policy, firewall or load balancer can name it"
        labels = job["spec"]["template"]["metadata"]["labels"]
        policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        mine = [p for p in policies if ks.selects(p["spec"]["podSelector"], labels)]
        sysctls = {s["name"]: s["value"] for s in pod.get("securityContext", {}).get("sysctls", [])}
        if pod.get("hostNetwork"):
            assert not mine, f"{name}: a NetworkPolicy does nothing for host-network pods"
            assert not sysctls, f"{name}: a host-network pod may not set namespaced sysctls"
            firewall = (KUBERNETES / "overlays" / name / "node-firewall.nft").read_text()
            for other, block in others[name]:
                assert re.search(rf"tcp dport {data}-(\d+) ip saddr {{[^}}]*{re.escape(block)}", firewall), \
                    f"{name}'s node firewall does not admit the data plane from {other} ({block})"
            sysctl = (KUBERNETES / "overlays" / name / "node-sysctl.conf").read_text()
            low, high = map(int, re.search(r"ip_local_port_range = (\d+) (\d+)", sysctl).groups())
            assert high < data or low > data + 63, f"{name}: the nodes' ephemeral ports overlap the data ports"
            nft = shutil.which("nft")
            if nft:  # syntax and semantics, in a network namespace of its own (needs root)
                check = subprocess.run(["unshare", "--net", nft, "-c", "-f",
                                        str(KUBERNETES / "overlays" / name / "node-firewall.nft")],
                                       capture_output=True, text=True, timeout=30)
                assert check.returncode == 0 or "Operation not permitted" in check.stderr, check.stderr
            continue
        assert len(mine) == 1, f"{name}: exactly one NetworkPolicy selects the workers"
        low, high = map(int, sysctls["net.ipv4.ip_local_port_range"].split())
        assert high < data or low > data + 63, f"{name}: the ephemeral ports overlap the data ports"
        rules = _admitted(mine[0])
        own = [s for s, ports in rules if (low, high) in ports and any(p <= data and data + ranks - 1 <= (e or p)
                                                                       for p, e in ports)
               and any(ks.selects(p.get("podSelector"), labels) and "namespaceSelector" not in p for p in s)]
        assert own, f"{name}: the group's own pods (Gloo, the data plane) are not admitted"
        for p in (p for s, _ in rules for p in s if "podSelector" in p):
            assert p["podSelector"]["matchLabels"].get("diloco.dev/group") == labels["diloco.dev/group"], \
                f"{name}: in-group traffic is admitted from another group's pods"
        outside = [(s, ports) for s, ports in rules if any("ipBlock" in p for p in s)]
        blocks = {p["ipBlock"]["cidr"] for s, ports in outside for p in s}
        assert blocks == {block for _, block in others[name]}, \
            f"{name}: the data plane is admitted from {blocks}, but the other datacenters send from {others[name]}"
        for _, ports in outside:  # the data ports, and nothing else, from outside
            assert all(data <= p and (e or p) <= data + 63 for p, e in ports) and \
                any(p <= data and data + ranks - 1 <= (e or p) for p, e in ports), f"{name}: {ports}"
        named = {p["containerPort"] for p in container["ports"]}
        single = {p for _, ports in rules for p, end in ports if end is None}
        assert single <= named, f"{name}: admits a port nothing listens on"
        if any(_component(o) == "coordinator" for o in objects):
            policy = _one(objects, "NetworkPolicy", "diloco-coordinator")
            (cjob,) = [o for o in objects if o["kind"] == "Job" and _component(o) == "coordinator"]
            cports = {p["containerPort"] for p in cjob["spec"]["template"]["spec"]["containers"][0]["ports"]}
            admitted = {p for _, ports in _admitted(policy) for p, _ in ports}
            assert admitted == cports
            outside = {p["ipBlock"]["cidr"] for s, _ in _admitted(policy) for p in s if "ipBlock" in p}
            assert outside == {block for _, block in others[name]}, f"the coordinator admits {outside}"
            external = [o for o in objects if o["kind"] == "Service" and o["spec"].get("type") == "LoadBalancer"]
            for svc in external:
                assert set(svc["spec"]["loadBalancerSourceRanges"]) == outside
                assert svc["spec"]["externalTrafficPolicy"] == "Local", "the policy must see the clients' addresses"
    for dc, plan in ADDRESSES.items():  # the plan itself: no two blocks overlap
        nets = [ipaddress.ip_network(b) for b in plan.values()]
        assert not any(a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:]), dc


def test_overlays_are_listed_for_the_docs():
    readme = (DEPLOY / "README.md").read_text()
    for overlay in OVERLAYS:
        assert f"overlays/{overlay.name}" in readme, f"deploy/README.md does not describe {overlay.name}"
    for dc, plan in ADDRESSES.items():
        for block in plan.values():
            assert block in readme, f"deploy/README.md does not give {dc}'s block {block}"


def test_gpu_component_requests_a_gpu_per_rank_and_sees_only_its_own(help_flags):
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with yamllint (the dev extras)")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH (it ships kustomize)")
    text = subprocess.run([kubectl, "kustomize", str(KUBERNETES / "examples" / "dc-a-gpu")], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    objects = [d for d in yaml.safe_load_all(text) if d]
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the dev extras)")
    for obj in objects:
        kv.validate(obj, kv.latest_version(), strict=True)
    job, container, _, worker_args = _worker(objects)
    env = _env(container)
    ranks = int(env["DILOCO_RANKS_PER_NODE"]["value"])
    resources = container["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == int(resources["requests"]["nvidia.com/gpu"]) == ranks
    assert _flags(worker_args)["--backend"] == "nccl" and set(_flags(worker_args)) <= help_flags["worker"]
    assert env["NCCL_SOCKET_IFNAME"]["value"] and "NVIDIA_VISIBLE_DEVICES" not in env
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {f"metrics-{i}" for i in range(ranks)} <= set(ports)
    assert container["image"].endswith("-cuda") and ":" in container["image"]
    assert any(t["key"] == "nvidia.com/gpu" for t in job["spec"]["template"]["spec"]["tolerations"])
