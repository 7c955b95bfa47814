"""``diloco status``: what a running coordinator knows, for people (a table) or tools (``--json``).

    DILOCO_TOKEN=... diloco status --address coord.example:9400     # the coordinator's --metrics-port
    diloco status --address 127.0.0.1:9304 --token-file RUN_DIR/coordinator-token --json   # diloco run

It reads the coordinator's ``/status`` JSON document over HTTP (``diloco.coordinator.metrics``),
next to its Prometheus ``/metrics``: membership, the current round, per-group progress and rates,
the latest bandwidth table and ring order, failed members and diverged rounds. ``/status`` names
every member's address, so a coordinator with a token (``diloco run``'s always has one) answers it
only with the job token: ``--token-file`` or ``$DILOCO_TOKEN``. Torch-free.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

TOKEN_ENV = "DILOCO_TOKEN"
#: a group's state from how its summary says it ended (``/status``'s ``ended``: ``rounds.summary_kind``'s
#: values, spelled out: this client reads JSON and imports nothing of the coordinator)
_ENDED = {"trained": "finished", "late": "joined late (no model)", "stopped": "stopped (SIGTERM; comes back)"}


class StatusError(RuntimeError):
    """The coordinator could not be asked; the message says why."""


def read_token_file(path: str) -> str:
    """The token in file ``path`` (surrounding white space removed); StatusError if it cannot be read
    or is empty."""
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as e:
        raise StatusError(f"cannot read the token file {path}: {e.strerror or e}") from None
    if not token:
        raise StatusError(f"the token file {path} is empty")
    return token


def fetch(address: str, *, token: str | None = None, token_file: str | None = None,
          timeout_s: float = 5.0) -> dict[str, Any]:
    """The ``/status`` document of the coordinator whose metrics port is at ``address``
    (``host:port`` or a URL). The job token it sends: ``token``, else the one in ``token_file``
    (``diloco run``'s ``RUN_DIR/coordinator-token``), else ``$DILOCO_TOKEN``, else none."""
    url = address if "://" in address else f"http://{address}"
    url = url.rstrip("/") + "/status"
    if token is None and token_file is not None:
        token = read_token_file(token_file)
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as e:
        why = ("wrong or missing token: the coordinator's job token, from --token-file (diloco run: "
               "RUN_DIR/coordinator-token) or DILOCO_TOKEN (a group's credential is not enough)"
               if e.code == 401 else f"HTTP {e.code}")
        raise StatusError(f"{url}: {why}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StatusError(f"cannot reach the coordinator's status endpoint {url}: {reason} "
                          "(is it started with --metrics-port?)") from None
    except json.JSONDecodeError as e:
        raise StatusError(f"{url}: not a status document: {e}") from None


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _percent(ratio: Any) -> str:
    shown = _num(ratio * 100 if isinstance(ratio, (int, float)) else None, ".1f")
    return shown if shown == "-" else shown + "%"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def format_status(doc: dict[str, Any]) -> str:
    """The status document as a few human-readable tables."""
    groups = doc.get("groups", [])
    ring = " -> ".join(str(g) for g in doc.get("ring_order", [])) or "(not formed)"
    quorum = "complete" if doc.get("complete") else "waiting for groups"
    lines = [
        f"diloco job: {len(groups)} of {doc.get('expected_groups')} groups joined, quorum {quorum}, "
        f"epoch {doc.get('epoch')}, {doc.get('finished_groups', 0)} finished",
        f"ring order: {ring}   (plan version {doc.get('plan_version')})",
    ]
    rs = doc.get("rounds_state")
    if rs:
        quorum_now = rs.get("last_quorum") or {}
        lines.append(
            f"rounds: {rs.get('committed', 0)} committed, {rs.get('rolled_back', 0)} rolled back, "
            f"{rs.get('heals', 0)} heals; live groups {rs.get('live_groups')}, healing {rs.get('healing_groups')}, "
            f"failed {sorted(rs.get('failed_groups', {}))}; last quorum {quorum_now.get('groups', '-')} "
            f"({quorum_now.get('decision') or 'open'})")
        if rs.get("resume_step", -1) >= 0:
            behind = ", ".join(f"group {g} (its newest: {'none' if s < 0 else f'step {s}'})"
                               for g, s in rs.get("resumed_behind", {}).items())
            lines.append(f"resumed from checkpoint step {rs['resume_step']}"
                         + (f"; behind it, healing from the others: {behind}" if behind else ""))
        if rs.get("job_lost"):
            lines.append(f"JOB LOST: {rs['job_lost']}")
        if rs.get("halted"):
            lines.append(f"JOB HALTED: {rs['halted']}")
    lines.append("")
    rows = [["group", "ranks", "failed", "step", "round", "H", "loss", "lr", "tokens/s", "util", "sent", "state"]]
    for g in groups:
        p = g.get("progress", {})
        step = f"{p['step']}/{p.get('steps', '?')}" if "step" in p else "-"
        state = _ENDED.get(g.get("ended")) or ("finished" if g.get("finished") else "FAILED" if g.get("failed")
                                               else "training" if p else "joined")
        rows.append([str(g["group"]), f"{g.get('joined')}/{g.get('size')}", str(g.get("failed", 0)), step,
                     _num(g.get("round"), "d"), _num(p.get("h"), "d"), _num(p.get("loss"), ".4f"),
                     _num(p.get("lr"), ".2e"), _num(p.get("tokens_per_s"), ",.0f"),
                     _percent(p.get("utilization")),
                     _bytes(p.get("bytes_sent")), state])
    lines += _table(rows) if groups else ["(no group has joined yet)"]
    lines += [f"auto (--codec/--h auto), group {g['group']}: {g['progress']['auto']}" for g in groups
              if g.get("progress", {}).get("auto")]
    bandwidth = doc.get("bandwidth", [])
    if bandwidth:
        peers = sorted({b["peer_group"] for b in bandwidth})
        lines += ["", "bandwidth, latest probe (MB/s, rank -> peer group):"]
        by_rank: dict[tuple[int, int], dict[int, float]] = {}
        for b in bandwidth:
            by_rank.setdefault((b["group"], b["rank"]), {})[b["peer_group"]] = b["bytes_per_second"]
        rows = [["group/rank", *[f"-> {p}" for p in peers]]]
        for (g, r), rates in sorted(by_rank.items()):
            rows.append([f"{g}/{r}", *[_num(rates[p] / 1e6, ".1f") if p in rates else "-" for p in peers]])
        lines += _table(rows)
    members = [(g["group"], r) for g in groups for r in g.get("ranks", [])]
    if members:
        lines += ["", "members:"]
        rows = [["group/rank", "address", "step", "state"]]
        for g, r in members:
            state = f"FAILED (silent {r['silent_s']:.0f} s)" if r.get("failed") else "ok"
            rows.append([f"{g}/{r['rank']}", str(r.get("address")), _num(r.get("step"), "d"), state])
        lines += _table(rows)
    for d in doc.get("divergence", []):
        lines.append(f"DIVERGED: round {d['round']}: global-parameter hashes differ: {d['hashes']}")
    return "\n".join(lines)


def main(address: str, *, as_json: bool = False, timeout_s: float = 5.0, token_file: str | None = None) -> int:
    """Entry point of ``diloco status``; prints the status, returns the exit code."""
    doc = fetch(address, token_file=token_file, timeout_s=timeout_s)
    print(json.dumps(doc, indent=2) if as_json else format_status(doc), flush=True)
    return 0
