"""Credentials as deployed (issue 46): every worker pod holds only its own group's credential and
keys, the job token only the coordinator's pod, and deploy/README.md creates exactly the Secrets
each datacenter's manifests read.

With the job token a worker host could re-join every group under a new incarnation ("job lost") or
stop the job; with the job's data-plane secret it could pose as any group. So a worker pod's env
may come only from its own group's Secret (``diloco-credentials-G``, written by ``diloco
credentials``), and the test materializes every rendered worker pod's env from minted Secrets to
check what a pod would actually hold. The replay (test_ops_replay.py) runs the pods with them.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from ops_helpers import DEPLOY, need_binary

from diloco.coordinator import credentials
from diloco.runtime.rank.endpoint import CREDENTIAL_FILES, SECRET_ENV, TOKEN_ENV, group_credentials
from transport.identity import GroupKeys

KUBERNETES = DEPLOY / "kubernetes"
EXAMPLES = sorted(p.parent for p in (KUBERNETES / "examples").glob("*/kustomization.yaml"))  # not storage/: no kustomization
COORDINATOR_TOKEN = ("diloco-coordinator-token", "token")
TOKEN = "the-operators-job-token-0123456789"
SECRET = bytes(range(100, 132))


@pytest.fixture(scope="module")
def every_build(rendered) -> dict[str, list[dict]]:
    """The overlays and the examples, as ``kubectl kustomize`` renders them."""
    yaml = pytest.importorskip("yaml")
    kubectl = need_binary("kubectl", "it ships kustomize: https://kubernetes.io/docs/tasks/tools/")
    out = dict(rendered)
    for example in EXAMPLES:
        text = subprocess.run([kubectl, "kustomize", str(example)], capture_output=True, text=True, timeout=60,
                              check=True).stdout
        out[f"examples/{example.name}"] = [d for d in yaml.safe_load_all(text) if d]
    return out


def _pods(objects: list[dict]):
    """(component, pod spec) of every pod template."""
    for obj in objects:
        template = obj.get("spec", {}).get("template")
        if template is not None:
            yield template["metadata"]["labels"].get("app.kubernetes.io/component"), template["spec"]


def _secret_refs(spec: dict) -> set[tuple[str, str | None]]:
    """(Secret, key) every container's env and every volume of a pod reads (key None: the whole Secret)."""
    refs: set[tuple[str, str | None]] = set()
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.add((ref["name"], ref["key"]))
        refs |= {(src["secretRef"]["name"], None) for src in c.get("envFrom", []) if "secretRef" in src}
    for v in spec.get("volumes", []):
        if "secret" in v:
            refs.add((v["secret"]["secretName"], None))
        for source in v.get("projected", {}).get("sources", []):
            if "secret" in source:
                refs.add((source["secret"]["name"], None))
    return refs


def _materialize(spec: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's env as the kubelet would set it from ``secrets`` (plain values as written)."""
    (container,) = spec["containers"]
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]], f"{ref} is not created"
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def test_every_worker_pod_reads_only_its_own_groups_secret(every_build):
    seen = set()
    for name, objects in every_build.items():
        for component, spec in _pods(objects):
            if component != "worker":
                continue
            (container,) = spec["containers"]
            env = {e["name"]: e for e in container.get("env", [])}
            g = int(env["DILOCO_GROUP_ID"]["value"])
            own = f"diloco-credentials-{g}"
            assert not container.get("envFrom"), f"{name}: envFrom would hand the pod every key of a Secret"
            assert env[SECRET_ENV]["valueFrom"]["secretKeyRef"] == {"name": own, "key": CREDENTIAL_FILES[SECRET_ENV]}
            assert env[TOKEN_ENV]["valueFrom"]["secretKeyRef"] == {"name": own, "key": CREDENTIAL_FILES[TOKEN_ENV]}
            refs = _secret_refs(spec)
            assert refs == {(own, key) for key in CREDENTIAL_FILES.values()} | {("diloco-tls", None)}, \
                f"{name}: group {g}'s pods read {sorted(refs, key=str)}"
            assert COORDINATOR_TOKEN[0] not in json.dumps(spec), f"{name}: a worker pod names the job token's Secret"
            seen.add(name)
    assert seen == set(every_build), f"every build has worker pods: {sorted(set(every_build) - seen)}"


def test_only_the_coordinators_pod_reads_the_job_token(every_build):
    readers = []
    for name, objects in every_build.items():
        for component, spec in _pods(objects):
            refs = _secret_refs(spec)
            if any(secret == COORDINATOR_TOKEN[0] for secret, _ in refs):
                readers.append((name, component))
                assert component == "coordinator" and (*COORDINATOR_TOKEN,) in refs, (name, component, refs)
                env = {e["name"]: e for e in spec["containers"][0]["env"]}
                assert env[TOKEN_ENV]["valueFrom"]["secretKeyRef"] == dict(zip(("name", "key"), COORDINATOR_TOKEN))
    assert readers == [("dc-a", "coordinator")], readers


def test_what_each_worker_pod_would_hold_proves_its_group_and_nothing_more(every_build):
    """Each pod's env materialized from Secrets minted as deploy/README.md mints them: no value is
    the job token or the data-plane secret, the credential is its group's (not an operator's) and
    the keyring is its group's, with a key per group and no way to derive another's."""
    secrets = {f"diloco-credentials-{g}": {CREDENTIAL_FILES[var]: value
                                           for var, value in group_credentials(TOKEN, SECRET, g, 2).items()}
               for g in range(2)}
    secrets[COORDINATOR_TOKEN[0]] = {COORDINATOR_TOKEN[1]: TOKEN}
    for name, objects in every_build.items():
        for component, spec in _pods(objects):
            env = _materialize(spec, secrets)
            if component == "coordinator":
                assert env[TOKEN_ENV] == TOKEN
                continue
            g = int(env["DILOCO_GROUP_ID"])
            held = "\n".join(env.values())
            assert TOKEN not in held and SECRET.hex() not in held, f"{name}: a worker pod holds the job's credentials"
            caller = credentials.check(TOKEN, env[TOKEN_ENV])
            assert caller == credentials.Caller(admin=False, group=g, verified=True), (name, caller)
            keys = GroupKeys.from_text(env[SECRET_ENV])
            assert keys.group == g and keys.peers == [0, 1], (name, keys)


def _readme_secrets() -> dict[str, set[tuple[str, str]]]:
    """{overlay: {(Secret, key)}} that deploy/README.md's commands create in that datacenter's cluster
    (a comment naming ``overlays/DC`` starts that datacenter's commands)."""
    text = (DEPLOY / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "create secret generic" in b)
    lines = block.replace("\\\n", " ").splitlines()
    out: dict[str, set[tuple[str, str]]] = {}
    dc = None
    for line in lines:
        m = re.match(r"\s*#.*overlays/(dc-[a-z])\b", line)
        if m:
            dc = m.group(1)
            continue
        m = re.search(r"create secret generic (\S+)(.*)", line.split("#")[0])
        if not m:
            continue
        assert dc is not None, f"deploy/README.md creates {m.group(1)} before naming a datacenter"
        secret, args = m.group(1), m.group(2).split()
        for arg in args:
            source = arg.partition("=")[2]
            if arg.startswith("--from-literal="):
                out.setdefault(dc, set()).add((secret, source.split("=", 1)[0]))
            elif arg.startswith("--from-file=") and "=" in source:
                out.setdefault(dc, set()).add((secret, source.split("=", 1)[0]))
            elif arg.startswith("--from-file="):  # a folder of `diloco credentials`: a key per file
                assert re.fullmatch(r"\S+/group-\d+", source), f"{secret}: --from-file={source}"
                out.setdefault(dc, set()).update((secret, key) for key in CREDENTIAL_FILES.values())
    return out


def test_the_readme_creates_in_each_cluster_what_its_manifests_read(rendered):
    readme = _readme_secrets()
    assert set(readme) == set(rendered), f"deploy/README.md creates Secrets for {sorted(readme)}"
    for name, objects in rendered.items():
        read = set()
        for _, spec in _pods(objects):
            for secret, key in _secret_refs(spec):
                if key is not None:
                    read.add((secret, key))
                else:  # a Secret volume: every key it names (the TLS files)
                    volume = next(v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == secret)
                    mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", [])
                              if m["name"] == volume["name"]]
                    paths = [a.split("=", 1)[1] for c in spec["containers"] for a in c.get("args", [])
                             if any(a.startswith("--tls-") and "=" in a and
                                    a.split("=", 1)[1].startswith(m["mountPath"] + "/") for m in mounts)]
                    read |= {(secret, p.rsplit("/", 1)[1]) for p in paths}
        assert read == readme[name], (f"{name}: the manifests read {sorted(read)}, deploy/README.md creates "
                                      f"{sorted(readme[name])}")
    job_token = {dc for dc, created in readme.items() if any(s == COORDINATOR_TOKEN[0] for s, _ in created)}
    assert job_token == {"dc-a"}, "the job token goes only to the coordinator's cluster"


def test_the_docs_name_the_minting_command():
    for doc in (DEPLOY / "README.md", DEPLOY.parent / "docs" / "operations.md"):
        text = doc.read_text()
        assert "diloco credentials --groups" in text, f"{doc.name} does not say how to mint a group's credentials"
        assert "diloco-secrets" not in text, f"{doc.name} still hands one job-wide Secret to every cluster"
