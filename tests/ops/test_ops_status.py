"""The coordinator's HTTP side (/metrics, /status, /healthz) and `diloco status`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from ops_helpers import SNAPSHOT

from diloco import cli
from diloco.coordinator.metrics import CoordinatorHttp, status_document
from diloco.runtime.ops.status import format_status


class FakeServer:
    """What CoordinatorHttp reads from a CoordinatorServer: snapshot() and stopped."""

    def __init__(self, snapshot: dict) -> None:
        self.snap, self.stopped = snapshot, False

    def snapshot(self) -> dict:
        return self.snap


@pytest.fixture
def http():
    server = FakeServer(SNAPSHOT)
    with CoordinatorHttp(server.snapshot, host="127.0.0.1", port=0, token="tok",
                         stopped=lambda: server.stopped) as h:
        yield server, h


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_status_document_holds_membership_rounds_progress_bandwidth_and_ring():
    doc = json.loads(json.dumps(status_document(SNAPSHOT, now=123.0)))  # JSON-able as served
    assert doc["time"] == 123.0 and doc["complete"] and doc["epoch"] == 1 and doc["ring_order"] == [1, 0]
    g0, g1 = doc["groups"]
    assert (g0["group"], g0["joined"], g0["size"], g0["round"], g0["finished"]) == (0, 2, 2, 4, True)
    assert g0["ranks"][1] == {"rank": 1, "address": "10.0.0.2:29502", "step": 40, "failed": False, "silent_s": None}
    assert g1["failed"] == 1 and g1["ranks"][0]["silent_s"] == 31.5
    assert g0["progress"]["tokens_per_s"] == 1234.5
    assert {"group": 0, "rank": 1, "peer_group": 1, "bytes_per_second": 1.0e8} in doc["bandwidth"]
    assert doc["divergence"][0]["round"] == 2 and doc["rounds_state"]["committed"] == 7


def test_format_status_shows_each_group_link_and_member():
    text = format_status(status_document(SNAPSHOT))
    assert "2 of 2 groups joined, quorum complete, epoch 1, 1 finished" in text
    assert "ring order: 1 -> 0" in text and "7 committed, 1 rolled back, 2 heals" in text
    lines = text.splitlines()
    row0 = next(line for line in lines if line.startswith("0 ") and "40/100" in line)
    assert "2/2" in row0 and "2.5000" in row0 and "1,234" in row0 and "80.0%" in row0 and "finished" in row0
    assert "5.0 MB" in row0
    row1 = next(line for line in lines if line.startswith("1 ") and "38/100" in line)
    assert "FAILED" in row1
    assert any(line.split() == ["0/1", "-", "100.0"] for line in lines), "rank 0/1's link to group 1: 100 MB/s"
    assert any("10.1.0.1:29503" in line and "FAILED (silent 32 s)" in line for line in lines)
    assert "DIVERGED: round 2" in text


def test_http_serves_metrics_and_status_and_guards_status_with_the_token(http):
    server, h = http
    base = f"http://127.0.0.1:{h.port}"
    code, body = _get(base + "/metrics")
    assert code == 200 and 'diloco_coordinator_group_round{group="0"} 4.0' in body
    assert _get(base + "/status")[0] == 401 and _get(base + "/status", token="wrong")[0] == 401
    code, body = _get(base + "/status", token="tok")
    assert code == 200 and json.loads(body)["groups"][0]["ranks"][0]["address"] == "10.0.0.1:29501"
    assert _get(base + "/healthz") == (200, "ok\n")
    assert _get(base + "/nothing")[0] == 404
    server.stopped = True
    assert _get(base + "/healthz")[0] == 503


def test_diloco_status_prints_the_table_and_json(http, capsys, monkeypatch):
    _, h = http
    monkeypatch.setenv("DILOCO_TOKEN", "tok")
    assert cli.main(["status", "--address", f"127.0.0.1:{h.port}"]) == 0
    assert "quorum complete" in capsys.readouterr().out
    assert cli.main(["status", "--address", f"http://127.0.0.1:{h.port}/", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expected_groups"] == 2
    monkeypatch.delenv("DILOCO_TOKEN")
    assert cli.main(["status", "--address", f"127.0.0.1:{h.port}"]) == 1
    assert "wrong or missing token" in capsys.readouterr().err


def test_diloco_status_names_an_unreachable_coordinator(capsys):
    with CoordinatorHttp(lambda: {}, host="127.0.0.1", port=0) as h:
        port = h.port  # free once closed
    assert cli.main(["status", "--address", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    assert f"cannot reach the coordinator's status endpoint http://127.0.0.1:{port}/status" in capsys.readouterr().err
