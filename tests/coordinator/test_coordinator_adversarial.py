"""The coordinator attacks of issue 15 (bench/adversarial.py at test size): impersonation of other
groups, and floods of blocking calls and slow requests, against a real coordinator with a token
while two honest groups run quorum -> all-reduce -> commit exchanges."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_adversarial", ROOT / "bench" / "adversarial.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = load_bench()
SETTINGS = replace(bench.Settings(), **bench.TEST)


@pytest.mark.parametrize("attack", list(bench.COORDINATOR_ATTACKS))
def test_attack(attack: str) -> None:
    rec = bench.run_attack(attack, SETTINGS)
    assert rec["honest_ok"], rec  # every honest exchange committed; Ping and heartbeats < 1 s
    assert rec["ping_max_s"] < 1.0 and rec["heartbeat_max_s"] < 1.0
    assert rec["rss_growth_mb"] <= 64, rec
    if attack == "coordinator-impersonation":
        assert rec["refused"], rec["answers"]
        assert rec["answers"]["anonymous join"] == "UNAUTHENTICATED"
        assert rec["answers"]["summary for group 1"] == "PERMISSION_DENIED" and rec["stop_requested"] is None
    else:
        answers = rec["flood_answers"]
        assert answers.get("RESOURCE_EXHAUSTED", 0) > 0 and answers.get("UNAUTHENTICATED", 0) > 0, answers
        assert rec["slow_call_answers"].get("CANCELLED", 0) > 0, rec["slow_call_answers"]
        assert rec["call_stats"]["blocking_peak"] <= rec["call_stats"]["max_blocking_calls"]
