"""Paths and small helpers shared by the operations tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p for p in (DEPLOY / "kubernetes" / "overlays").iterdir() if p.is_dir())

# The addresses the manifests assume (deploy/README.md, "Addresses"): each datacenter's pod network,
# its nodes' interconnect addresses and its internal load balancers. Where a datacenter's ranks
# send from: their pods' block on a routed pod network, their nodes' block on the host network.
ADDRESSES = {
    "dc-a": {"pods": "10.10.0.0/16", "nodes": "10.12.0.0/16", "load_balancers": "10.11.0.0/24"},
    "dc-b": {"pods": "10.20.0.0/16", "nodes": "10.21.0.0/16", "load_balancers": "10.22.0.0/24"},
}


def need_binary(name: str, how: str) -> str:
    """The path of ``name``, or skip the test saying how to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not on PATH ({how})")
    return path


# a coordinator snapshot with every key filled (the shape CoordinatorServer.snapshot() documents)
SNAPSHOT = {
    "expected_groups": 2, "epoch": 1, "complete": True,
    "groups": {0: {"ranks": {0: "10.0.0.1:29501", 1: "10.0.0.2:29502"}, "group_size": 2},
               1: {"ranks": {0: "10.1.0.1:29503"}, "group_size": 1}},
    "ring_order": [1, 0],
    "steps": {0: {0: 40, 1: 40}, 1: {0: 38}},
    "progress": {0: {"step": 40, "steps": 100, "tokens_per_s": 1234.5, "bytes_sent": 5_000_000, "round": 4,
                     "h": 10, "utilization": 0.8, "loss": 2.5, "lr": 1e-3},
                 1: {"step": 38, "steps": 100, "tokens_per_s": "n/a", "bytes_sent": 4_000_000, "round": 3,
                     "h": 10, "utilization": 0.7, "loss": float("nan")}},
    "progress_by_rank": {},
    "summaries": {0: {"group": 0}},
    "rounds": {0: 4, 1: 3},
    "failed": [{"group": 1, "rank": 0, "silent_s": 31.5}],
    "divergence": [{"round": 2, "hashes": {0: "aa", 1: "bb"}}],
    "plan_version": 3,
    "bandwidth": {0: {0: {1: 1.25e8}, 1: {1: 1.0e8}}, 1: {0: {0: 2.5e7}}},
    "rounds_state": {"committed": 7, "rolled_back": 1, "heals": 2, "failures": 1, "rejected": 3, "evicted": 0,
                     "caught_up": 1,
                     "live_groups": [0], "healing_groups": [], "failed_groups": {1: "silent"},
                     "last_quorum": {"groups": [0], "decision": "committed"}},
}
