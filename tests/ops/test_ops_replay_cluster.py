"""The manifest replay as a cluster behaves: a multi-pod group, pods killed, deleted and evicted in
every role, the kubelet's probes, a load balancer that becomes ready after its pod.

One job (``k8s_replay``, as ``test_ops_replay.py`` runs it) with group 0 on two pods of dc-a
(``torchrun --nnodes 2`` across two pod network namespaces: its rendezvous, the in-group Gloo
connections on the ports of the manifest's ``ip_local_port_range``, admitted by group 0's
NetworkPolicy, one checkpoint folder shared by both pods) and group 1 on one host-network pod of
dc-b. The coordinator's startup, liveness and readiness probes run all along, as the kubelet runs
them (the manifest's periods and timeouts, scaled by the replay's time scale, timeouts at least
1 s), against the loaded coordinator; Services forward to ready pods only, and dc-a's internal load
balancer only seconds after the coordinator became ready. Then:

A. a pod of the multi-pod group is SIGKILLed: the killed index is counted (once), the surviving
   pod's exit is "restart me" (75: ignored), the Job replaces both and group 0 heals from group 1;
B. then a whole-cluster drain at once: group 0's other pod deleted (``kubectl delete pod``: SIGTERM,
   the grace period, SIGKILL, no DisruptionTarget), group 1's pod preempted (DisruptionTarget: no
   PodDisruptionBudget stops it) and the coordinator deleted: each exits 75 (ignored: no budget
   spent), nothing is Complete, and the new pods resume from the checkpoint volumes;

and the job finishes: every Job Complete, the coordinator's summary says the groups' global
parameters are identical, no probe ever failed the coordinator, and no budget was spent but the
SIGKILLed index's. What the product must do (exit codes) is collected and asserted at the end, so
that one run names every gap; the replay's own mechanics are asserted at once.

A second, cheap replay (the coordinator's Job alone, no torch) hangs the coordinator (SIGSTOP): its
liveness probe fails ``failureThreshold`` times and the kubelet kills it (SIGTERM, the grace
period, SIGKILL: 137, counted against the Job's ``backoffLimit``, as on a cluster), the terminating
pod leaves its Services (no DNAT rule left), and the Job's new pod starts, becomes ready and is back
behind the Services.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import test_ops_replay as base

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

# enough steps that group 1, training on alone, cannot finish before group 0 is back: a survivor that
# waits out the 15 s heartbeat, then the restart, took 30 s on a loaded 2-core machine (group 1 then
# finished 300 steps at 45 s; the coordinator's summary leaves such a late group out)
STEPS, EVERY = 450, 50
LB_DELAY_S = 4.0
RESTART_ME = 75


def _established(r, pod, peer_ip: str) -> list[tuple[int, int]]:
    """(local port, remote port) of the TCP connections established between pod and peer_ip."""
    out = base.run("ip", "netns", "exec", pod.netns, "ss", "-Htn", "state", "established").stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        local, remote = parts[-2], parts[-1]
        if remote.rsplit(":", 1)[0] == peer_ip:
            found.append((int(local.rsplit(":", 1)[1]), int(remote.rsplit(":", 1)[1])))
    return found


@pytest.fixture
def cluster(tmp_path: Path, rendered):
    r = base._make_replay(tmp_path, rendered, base.DATACENTERS, {"dc-b": base._node_setup},
                          scaled={"nodes": (2, 1), "steps": STEPS, "every": EVERY}, lb_delay_s=LB_DELAY_S)
    try:
        yield r
    finally:
        r.close()
        shutil.rmtree(r.workdir, ignore_errors=True)


def test_replayed_cluster_multi_pod_group_kills_deletions_evictions_probes_and_finishes(cluster):
    r = cluster
    t0 = time.monotonic()
    coordinator = r.workload("diloco-coordinator", "dc-a")
    groups = {0: r.workload("diloco-group-0", "dc-a"), 1: r.workload("diloco-group-1", "dc-b")}
    jobs = [coordinator, *groups.values()]
    claims = {0: ("dc-a", "diloco-checkpoints-0"), 1: ("dc-b", "diloco-checkpoints-1")}
    r.start()
    timings = {}
    gaps: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            gaps.append(what)

    def running_all() -> None:
        if any(w.status != "Running" for w in jobs):
            pytest.fail(f"a Job ended: {[(w.name, w.status, w.reason) for w in jobs]}; gaps so far: {gaps}\n{r.report()}")

    def replaced(w, old: list) -> bool:
        return all(p not in old and p.phase == "Running" for p in w.pods.values()) or w.status != "Running"

    # 0. the job trains with group 0 on two pods, each in its own network namespace
    r.wait_for("the first checkpoint of both groups", lambda: all(base._step_done(r, *claims[g], g, EVERY) for g in groups)
               or any(w.status != "Running" for w in jobs), 150)
    running_all()
    timings["trains"] = round(time.monotonic() - t0, 1)
    a0, a1 = groups[0].pods[0], groups[0].pods[1]
    assert a0.netns != a1.netns and a0.ip != a1.ip
    # torchrun's store (pod 0's :29401) and Gloo's pairs cross the pods; Gloo listens on the pods'
    # ephemeral ports (the manifest's sysctl), which group 0's NetworkPolicy must admit
    sysctl = next(s["value"] for s in a0.spec["securityContext"]["sysctls"] if s["name"] == "net.ipv4.ip_local_port_range")
    low, high = map(int, sysctl.split())
    links = _established(r, a1, a0.ip) + [(b, a) for a, b in _established(r, a0, a1.ip)]
    assert any(low <= remote <= high for _, remote in links), (links, sysctl)
    assert any(remote == 29401 for _, remote in links), f"torchrun's store on pod 0 :29401: {links}"
    # the coordinator's probes run and pass under load; its load balancer came up after it
    coord = coordinator.pods[0]
    assert coord.started_ok and coord.ready, {k: (v["ok"], v["failed"], v["last_error"]) for k, v in coord.probes.items()}
    assert coord.probes["liveness"]["ok"] > 0 and coord.probes["readiness"]["ok"] > 0
    lb = [e for e in r.events if "load balancer diloco-coordinator-external" in e]
    assert "not ready yet" in lb[0] and lb[1].endswith("ready"), lb

    # A. a pod of the multi-pod group SIGKILLed
    r.kill(a1, signal.SIGKILL)
    r.wait_for("group 0's pods to be replaced", lambda: replaced(groups[0], [a0, a1]), 90)
    running_all()
    ended = {h["pod"]: h for w in jobs for h in w.history}
    assert ended[a1.name]["exit_code"] == 137 and ended[a1.name]["action"] == "Count", ended
    expect(ended[a0.name]["exit_code"] == RESTART_ME, f"the survivor of a lost in-group peer exits 75: {ended[a0.name]}")
    expect(groups[0].index_failures == {1: 1}, f"only the killed index is counted: {groups[0].index_failures}")
    healers = list(groups[0].pods.values())
    r.wait_for("group 0 to heal", lambda: all("healed from group 1" in p.log_text() or p.phase != "Running"
                                              for p in healers), 90)
    running_all()
    assert all(p.phase == "Running" for p in healers), r.report()
    timings["A healed"] = round(time.monotonic() - t0, 1)
    newest = max(base._newest(r, *claims[g], g) for g in groups)
    timings["A healed, step"] = newest
    assert newest <= STEPS - 2 * EVERY, f"the job is nearly done (step {newest}): raise STEPS"

    # B. a whole-cluster drain: a plain deletion, a preemption (DisruptionTarget), the coordinator deleted
    drained = [groups[0].pods[0], groups[1].pods[0], coordinator.pods[0]]
    r.wait_for("a checkpoint both groups wrote after the heal", lambda: base._common_since(r, claims, 0) > newest or any(w.status != "Running" for w in jobs), 60)
    r.delete(drained[0])
    r.delete(drained[1], disruption=True, reason="preempted")
    r.delete(drained[2])
    r.wait_for("the drained pods to end", lambda: all(p.phase != "Running" for p in drained), 60)
    ended = {h["pod"]: h for w in jobs for h in w.history}
    for pod in drained:
        tail = "\n      ".join(pod.log_text().splitlines()[-6:])
        expect(ended[pod.name]["exit_code"] == RESTART_ME,
               f"a {pod.ended_by} {pod.owner.name} pod with work left exits 75: {ended[pod.name]}; its log:\n      {tail}")
    assert ended[drained[1].name]["disruption_target"]
    running_all()
    r.wait_for("the Jobs to finish", lambda: all(w.status != "Running" for w in jobs), 240)
    timings["finished"] = round(time.monotonic() - t0, 1)
    assert all(w.status == "Complete" for w in jobs), f"gaps: {gaps}\n{r.report()}"
    summary = coordinator.pods[0].log_text()
    assert re.search(r"global params identical\s*: True", summary), summary[-3000:]
    for g, w in groups.items():
        for pod in w.pods.values():
            assert "resumed from" in pod.log_text() or "healed from" in pod.log_text(), f"{pod.name}\n{r.report()}"
    expect(groups[0].index_failures == {1: 1} and groups[1].failures == 0,
           f"budgets spent: group 0 {groups[0].index_failures}, group 1 {groups[1].failures}")
    expect(coordinator.failures == 0, f"the coordinator spent no budget: {coordinator.history}")
    assert not any("probe failed" in h["ended_by"] for h in coordinator.history), coordinator.history
    print(f"replay cluster: {timings}\n" + "\n".join(r.events))
    assert not gaps, "the job finished, but:\n" + "\n".join(gaps)


def test_replayed_coordinator_probes_take_a_hung_coordinator_out_and_the_kubelet_restarts_it(tmp_path, rendered):
    alone = {dc: [o for o in objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == "coordinator"
                  or o["kind"] == "ConfigMap"] for dc, objects in rendered.items()}
    r = base._make_replay(tmp_path, alone, base.DATACENTERS, {})
    r.min_grace_s = 3.0  # the hung coordinator never handles its SIGTERM: no need to wait longer
    try:
        coordinator = r.workload("diloco-coordinator", "dc-a")
        r.start()
        coord = coordinator.pods[0]
        r.wait_for("the coordinator to be ready", lambda: coord.ready or coord.phase != "Running", 60)
        service = r.service_ips[("dc-a", "diloco-coordinator")]

        def dnat() -> str:
            return base.run("ip", "netns", "exec", r.net.router, "nft", "list", "table", "ip", "replay").stdout

        assert f"ip daddr {service} tcp dport 29400 dnat to {coord.ip}:29400" in dnat()
        started = time.monotonic()
        os.kill(coord.container_pid(), signal.SIGSTOP)
        # the readiness probe (tcpSocket) may well pass on a hung process (the kernel still accepts
        # into its listen backlog); the liveness probe (httpGet /healthz) does not
        r.wait_for("the kubelet to start ending the hung coordinator", lambda: coord.kill_at is not None, 60)
        assert f"dnat to {coord.ip}" not in dnat(), "a terminating pod is no Service's endpoint"
        r.wait_for("the liveness probe to end the hung coordinator", lambda: coord.phase != "Running", 60)
        (ended,) = coordinator.history
        assert ended["ended_by"].startswith("liveness probe failed") and ended["exit_code"] == 137, ended
        assert ended["action"] == "Count" and coordinator.failures == 1, ended
        live = coord.spec["containers"][0]["livenessProbe"]
        least = (int(live["failureThreshold"]) - 1) * float(live["periodSeconds"]) * r.time_scale
        assert time.monotonic() - started >= least, "the liveness probe ended it before failureThreshold failures"
        r.wait_for("the Job's new coordinator to be ready", lambda: coordinator.pods[0] is not coord
                   and coordinator.pods[0].ready or coordinator.status != "Running", 60)
        assert coordinator.status == "Running", r.report()
        assert f"dnat to {coordinator.pods[0].ip}:29400" in dnat()
        print("\n".join(r.events))
    finally:
        r.close()
        shutil.rmtree(r.workdir, ignore_errors=True)


def test_replayed_volumes_honour_access_modes_and_the_drivers_fsgroup_policy(tmp_path, rendered):
    """Volumes as storage drivers make them: group 0's claim made ReadWriteOnce while the group has
    two pods on two nodes (the second pod stays Pending with a Multi-Attach error: why the manifests
    ask for ReadWriteMany, deploy/README.md "Checkpoint storage"), and group 1's ReadWriteMany claim
    on a driver with Kubernetes' default fsGroupPolicy (ReadWriteOnceWithFSType: fsGroup is not
    applied to a ReadWriteMany volume, whose root stays root's, 0755): uid 10001 cannot write its
    checkpoint folder, the worker stops at its preflight with exit 2, naming the folder, and the
    podFailurePolicy fails the Job at once (the documented clear stop, not a crash loop)."""
    patched = json.loads(json.dumps(rendered))
    for obj in patched["dc-a"]:
        if obj["kind"] == "PersistentVolumeClaim" and obj["metadata"]["name"] == "diloco-checkpoints-0":
            obj["spec"]["accessModes"] = ["ReadWriteOnce"]
    policies = {("dc-a", "diloco-checkpoints-0"): "ReadWriteOnceWithFSType",
                ("dc-b", "diloco-checkpoints-1"): "ReadWriteOnceWithFSType"}
    r = base._make_replay(tmp_path, patched, base.DATACENTERS, {"dc-b": base._node_setup},
                          scaled={"nodes": (2, 1), "steps": STEPS, "every": EVERY}, fs_group_policy=policies)
    try:
        groups = {0: r.workload("diloco-group-0", "dc-a"), 1: r.workload("diloco-group-1", "dc-b")}
        r.start()
        r.wait_for("group 1's Job to stop", lambda: groups[1].status != "Running", 120)
        assert groups[1].status == "Failed" and "exited 2" in groups[1].reason, (groups[1].reason, r.report())
        (ended,) = groups[1].history
        assert ended["exit_code"] == 2 and ended["action"] == "FailJob", ended
        log = groups[1].pods[0].log_text()
        assert "/var/lib/diloco/checkpoints" in log, log[-2000:]
        assert any("fsGroup not applied to diloco-checkpoints-1" in e for e in r.events), r.events
        # group 0: pod 0 has the ReadWriteOnce volume (fsGroup applied: a ReadWriteOnce volume), pod 1
        # waits for it on another node
        assert groups[0].pods[0].phase == "Running", r.report()
        assert groups[0].pods[1].phase == "Pending" and "Multi-Attach" in groups[0].pods[1].ended_by, r.report()
        folder = r.workdir / "pvcs" / "dc-a" / "diloco-checkpoints-0"
        assert folder.stat().st_gid == 10001, "fsGroup applies to a ReadWriteOnce volume"
        print("\n".join(r.events))
    finally:
        r.close()
        shutil.rmtree(r.workdir, ignore_errors=True)


_LISTEN = ("import socket, sys\n"
           "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
           "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(8)\n"
           "while True:\n"
           "    c, peer = s.accept()\n"
           "    with open(sys.argv[2], 'a') as f:\n"
           "        f.write(peer[0] + '\\n')\n"
           "    c.close()\n")
_DIAL = ("import socket, sys\n"
         "try:\n"
         "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print('ok')\n"
         "except OSError as e:\n"
         "    print(type(e).__name__)\n")


def test_replayed_source_nat_on_pod_egress_the_peer_sees_the_node(tmp_path, rendered):
    """Datacenter A's pod network still routed, but its pods' connections out of A translated to a
    node's address (source NAT on egress, as many clouds do for traffic leaving the pod range): a
    listener on a dc-b node sees 10.12.0.1, not the pod's 10.10.x address. Then the data-plane
    port behind dc-b's node firewall (overlays/dc-b/node-firewall.nft) as shipped, which admits A's
    node range beside its pod range: group 0's ranks reach group 1 under SNAT."""
    plans = json.loads(json.dumps(base.DATACENTERS))
    plans["dc-a"].update(pod_egress="10.12.0.1", pod_routed=True)
    r = base._make_replay(tmp_path, {dc: [] for dc in rendered}, plans, {})
    try:
        r.start()
        node = r.net.attach("dc-b-node-snat", "10.21.0.11", ifname="eth1")
        base._node_setup(node)
        seen = {}
        for port in (8080, 29500):
            out = r.workdir / f"peers-{port}"
            out.touch()
            proc = subprocess.Popen(["ip", "netns", "exec", node, sys.executable, "-c", _LISTEN, str(port), str(out)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            r._spawned.append(proc)  # close() ends it
            for _ in range(50):
                if base.run("ip", "netns", "exec", node, "ss", "-Htln", f"sport = :{port}").stdout.strip():
                    break
                time.sleep(0.1)
            result = r.exec_in("dc-a", sys.executable, "-c", _DIAL, "10.21.0.11", str(port)).stdout.strip()
            time.sleep(0.3)
            seen[port] = (result, out.read_text().split())
        assert seen[8080] == ("ok", ["10.12.0.1"]), f"the peer sees A's node address, not the pod's: {seen}"
        assert seen[29500][0] == "ok", f"dc-b's node firewall refuses A's source-NATed data plane: {seen}"
        assert seen[29500][1] == ["10.12.0.1"], seen
    finally:
        r.close()
        shutil.rmtree(r.workdir, ignore_errors=True)


_PLAIN = """if [ "$JOB_COMPLETION_INDEX" = 0 ]; then trap 'exit 75' TERM; else trap '' TERM; fi
echo trapped
while true; do sleep 0.2; done
"""


def test_replay_kubelet_and_job_controller_on_plain_containers(tmp_path):
    """The replay's kubelet and Job controller alone, on shell containers (seconds, no torch): a
    PodDisruptionBudget refuses an eviction; a deleted pod gets SIGTERM (index 0 exits 75: ignored,
    replaced), one that ignores it gets SIGKILL when its grace period ends (137: counted against
    its index's backoffLimitPerIndex); a disruption with DisruptionTarget is ignored whatever the
    exit; the index's second counted failure exceeds backoffLimitPerIndex 1, and with
    maxFailedIndexes 0 the Job fails, its other pods killed."""
    base._need_replay()
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "plain", "namespace": "t"}, "spec": {
        "completionMode": "Indexed", "completions": 2, "parallelism": 2, "backoffLimitPerIndex": 1,
        "maxFailedIndexes": 0, "podReplacementPolicy": "Failed",
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onExitCodes": {"containerName": "c", "operator": "In", "values": [75]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
        "template": {"metadata": {"labels": {"app": "plain"}}, "spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 30,
            "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "runAsNonRoot": True},
            "containers": [{"name": "c", "command": ["/bin/sh", "-c", _PLAIN]}]}}}}
    pdb = {"kind": "PodDisruptionBudget", "metadata": {"name": "plain"},
           "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "plain"}}}}
    workdir = tmp_path / "replay"
    workdir.mkdir()
    from k8s_network import Datacenter
    from k8s_semantics import read_image

    r = base.kr.Replay(workdir, {"dc-a": Datacenter("dc-a", **base.DATACENTERS["dc-a"])}, {"dc-a": [job, pdb]},
                       secrets={}, image=read_image(base.ROOT / "Dockerfile", "cpu"), repo=base.ROOT)
    r.min_grace_s = 1.0
    try:
        w = r.workload("plain")
        r.start()
        r.wait_for("both pods", lambda: len(r.running()) == 2, 30)
        assert r.evict(w.pods[0]) == (False, "PodDisruptionBudget plain allows no disruption")

        def delete(pod, **how) -> None:  # once its shell set its trap: a SIGTERM before it would end it as 143
            r.wait_for(f"{pod.name}'s trap", lambda: "trapped" in pod.log_text(), 30)
            r.delete(pod, **how)

        def ended(pod) -> dict:
            r.wait_for(f"{pod.name} to end", lambda: pod.phase != "Running", 30)
            return next(h for h in w.history if h["pod"] == pod.name)

        def replaced(i: int, old) -> None:
            r.wait_for(f"index {i}'s new pod", lambda: w.pods[i] is not old and w.pods[i].phase == "Running"
                       or w.status != "Running", 30)

        first = w.pods[0]
        delete(first)
        assert ended(first) | {"pod": ""} == {"pod": "", "index": 0, "phase": "Failed", "exit_code": 75,
                                             "ended_by": "deleted", "disruption_target": False, "action": "Ignore"}, r.report()
        replaced(0, first)
        stubborn = w.pods[1]
        started = time.monotonic()
        delete(stubborn)
        h = ended(stubborn)
        assert h["exit_code"] == 137 and h["action"] == "Count" and w.index_failures == {1: 1}, h
        assert time.monotonic() - started >= 30 * r.time_scale - 0.5, "SIGKILL only when the grace period ends"
        replaced(1, stubborn)
        preempted = w.pods[1]
        delete(preempted, disruption=True, reason="preempted")
        h = ended(preempted)
        assert h["exit_code"] == 137 and h["disruption_target"] and h["action"] == "Ignore", h
        assert w.index_failures == {1: 1}
        replaced(1, preempted)
        last = w.pods[1]
        delete(last)
        assert ended(last)["action"] == "Count"
        r.wait_for("the Job to fail", lambda: w.status != "Running", 30)
        assert w.status == "Failed" and "maxFailedIndexes 0" in w.reason and w.failed_indexes == {1}, w.reason
        assert all(p.phase != "Running" for p in w.pods.values()), r.report()
    finally:
        r.close()
        shutil.rmtree(workdir, ignore_errors=True)
