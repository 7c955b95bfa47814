"""A live ``diloco run`` as a compromised worker host would see it (issue 46, "credentials as deployed").

While the job trains, the test reads what one group's processes hold (their environment, as
anyone on that group's host could) and attacks with it: group 1's credential cannot re-join group 0
under a new incarnation, cannot stop the job and cannot read ``/status``; ``/status`` without the
job token is 401. No process of any group holds the job token, and each group holds only its own
credential and keys. Every socket the run listens on is on the ``--host`` asked for (127.0.0.1):
none on 0.0.0.0 or ::, the torchrun agents' stores and the workers' Gloo included. The job then
ends as if nothing happened: every group's global parameters bit-identical, no group restarted.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from diloco_helpers import free_port_range

from diloco.coordinator import CoordinatorClient, CoordinatorError
from diloco.coordinator.credentials import group_token, parse_group_token
from diloco.runtime.launch.launcher import STATUS_TOKEN_FILE
from transport.identity import GroupKeys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "8",
         "--eval-batches", "2", "--h", "10", "--probe-bytes", "0", "--no-progress"]


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _listening() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket of this network namespace."""
    out = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(path).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = fields[1].split(":")
            words = [struct.pack("<I", int(hexaddr[i:i + 8], 16)) for i in range(0, len(hexaddr), 8)]
            out[int(fields[9])] = (socket.inet_ntop(family, b"".join(words)), int(hexport, 16))
    return out


def listeners(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes ``pids`` hold."""
    table, out = _listening(), []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", target)
            if m and int(m.group(1)) in table:
                out.append((pid, *table[int(m.group(1))]))
    return out


def _plain(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address)
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _get(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_groups_credential_cannot_act_for_another_and_the_run_listens_only_on_its_host(tmp_path):
    metrics = free_port_range(4)  # group 0's two ranks, group 1's one, then the coordinator's /metrics and /status
    run_dir, summary = tmp_path / "run", tmp_path / "summary.json"
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "run", *SMALL, "--steps", "400", "--group-sizes", "2,1",
                             "--groups", "2", "--metrics-port", str(metrics), "--run-dir", str(run_dir),
                             "--json", str(summary), "--run-timeout", "240"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    status_url = f"http://127.0.0.1:{metrics + 3}/status"
    try:
        # the job token is the operator's: in the run dir, for the user who started the run only
        token_file = run_dir / STATUS_TOKEN_FILE
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the groups did not start training"
            if token_file.exists() and token_file.read_text():
                job_token = token_file.read_text()
                try:
                    with urllib.request.urlopen(urllib.request.Request(
                            status_url, headers={"Authorization": f"Bearer {job_token}"}), timeout=5) as r:
                        groups = json.load(r)["groups"]
                except OSError:
                    groups = []
                steps = [int((g.get("progress") or {}).get("step") or 0) for g in groups]
                if len(steps) == 2 and min(steps) >= 20:
                    break
            time.sleep(0.5)
        assert token_file.stat().st_mode & 0o777 == 0o600

        tree = process_tree(proc.pid)
        agents = {p: int(_flag(_cmdline(p), "--group-id")) for p in tree
                  if _cmdline(p)[1:4] == ["-m", "diloco", "torchrun"]}
        workers = {p: int(_flag(_cmdline(p), "--group-id")) for p in tree
                   if "worker" in _cmdline(p) and "torchrun" not in _cmdline(p)}
        assert sorted(agents.values()) == [0, 1] and sorted(workers.values()) == [0, 0, 1], (agents, workers)

        # every listening socket of the run is on 127.0.0.1 (the --host asked for), each agent's stores too
        held = listeners(tree)
        assert all(_plain(addr) == ipaddress.ip_address("127.0.0.1") for _, addr, _ in held), held
        by_pid = {pid: [port for p, _, port in held if p == pid] for pid in tree}
        assert len(by_pid[proc.pid]) == 2, "the coordinator's gRPC and HTTP ports"
        for pid, g in agents.items():  # the rendezvous store and the store its workers share
            assert len(by_pid[pid]) == 2, (g, held)
        for pid in workers:  # data plane and metrics; Gloo in group 0
            assert len(by_pid[pid]) >= 2, held

        # each group's processes hold its own credential and keys, and nothing of the job's
        for pid, g in {**agents, **workers}.items():
            env = _environ(pid)
            assert job_token not in "\0".join(env.values()), f"group {g}'s process {pid} holds the job token"
            assert env["DILOCO_TOKEN"] == group_token(job_token, g)
            keys = GroupKeys.from_text(env["DILOCO_SECRET"])
            assert keys.group == g and keys.peers == [0, 1]

        # group 1's host attacks with what it holds
        stolen = _environ(next(p for p, g in agents.items() if g == 1))["DILOCO_TOKEN"]
        assert parse_group_token(stolen) == 1
        coordinator = _flag(_cmdline(next(iter(agents))), "--coordinator")
        with CoordinatorClient(coordinator, token=stolen, timeout_s=10.0) as evil:
            with pytest.raises(CoordinatorError) as rejoin:  # group 0 under a new incarnation: the "job lost" attack
                evil.join(0, 0, 2, "127.0.0.1:9", incarnation="attacker", timeout_s=10.0)
            assert rejoin.value.code == "PERMISSION_DENIED", rejoin.value
            with pytest.raises(CoordinatorError) as stop:
                evil.request_stop("attacker")
            assert stop.value.code == "PERMISSION_DENIED", stop.value
        assert _get(status_url, stolen) == 401 and _get(status_url, None) == 401
        assert _get(status_url, job_token) == 200

        output = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-3000:]
    result = json.loads(summary.read_text())
    assert result["params_identical"], result["param_hash_per_group"]
    assert result["fault"]["restarts"] == 0 and result["fault"]["failures"] == 0, result["fault"]
    assert not token_file.exists(), "the token file outlives the run"
