"""bench/goodput_faults.py: commit records read back from real worker log lines, the common window,
goodput of a faulty job against its twin, restart down-times, the ledger's counts, interval parsing."""

import importlib
import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
gf = importlib.import_module("bench.goodput_faults")

from diloco.exchange.data_positions import DataPositions
from diloco.runtime.logs import TextFormatter


def worker_lines(caplog, group: int, rank: int, commits: list[tuple[str, dict[int, float]]], created: float) -> list[str]:
    """The text log lines a worker writes for ``commits`` (DataPositions' own records, the worker's formatter)."""
    pos = DataPositions(group, tokens_per_step=8.0)
    pos.samples_per_step = 8
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diloco.exchange.data_positions"):
        for tag, weights in commits:
            pos.commit(tag, weights)
    lines = []
    for i, rec in enumerate(r for r in caplog.records if "committed data" in r.getMessage()):
        rec.component, rec.group, rec.rank, rec.created = "worker", group, rank, created + i
        lines.append(TextFormatter().format(rec))
    return lines


def test_commits_are_read_back_from_the_workers_own_log_lines_with_their_times(caplog):
    t0 = 1_800_000_000.0
    lines = worker_lines(caplog, 3, 0, [("f0/r0", {3: 16.0, 1: 8.0}), ("f0/r1", {3: 8.0}), ("ctl", {3: 8.0})], t0)
    lines += worker_lines(caplog, 3, 1, [("f0/r0", {3: 16.0})], t0)  # rank 1's copy: not counted
    lines.append("2026-01-01T00:00:00.000Z INFO x [worker group 3 rank 0] something else")
    commits = gf.commits_from_logs(lines)
    # 16 weight / 8 per step = 2 steps x 8 samples; then 1 step; a control exchange carries no data
    assert commits == [(pytest.approx(t0), 3, 0, 16), (pytest.approx(t0 + 1), 3, 16, 24)]


def test_goodput_counts_commits_in_the_common_window_only():
    free = [(10.0, 0, 0, 100), (20.0, 0, 100, 200), (30.0, 0, 200, 300), (40.0, 0, 300, 400)]
    fault = [(15.0, 1, 0, 100), (25.0, 1, 100, 150), (35.0, 1, 150, 250), (50.0, 1, 250, 350)]
    assert gf.common_window({"a": free, "b": fault}) == (15.0, 40.0)
    assert gf.committed_between(fault, 15.0, 40.0) == 150  # (15, 40]: the commit at 15 opened the window
    r = gf.pair_result({"commits": fault, "eval_loss": 2.02, "committed_tokens": 350 * 4},
                       {"commits": free, "eval_loss": 2.0, "committed_tokens": 400 * 4}, together=True,
                       tokens_per_sample=4)
    assert r["window_s"] == 25.0
    assert r["tokens_per_s"] == pytest.approx(150 * 4 / 25) and r["free_tokens_per_s"] == pytest.approx(300 * 4 / 25)
    assert r["goodput"] == pytest.approx(0.5)
    assert r["eval_loss_vs_free_at_equal_steps"] == pytest.approx(0.01)
    assert r["tokens_vs_free"] == pytest.approx(-0.125)
    apart = gf.pair_result({"commits": fault, "eval_loss": 1.0, "committed_tokens": 1},
                           {"commits": free, "eval_loss": 1.0, "committed_tokens": 1}, together=False,
                           tokens_per_sample=4)
    assert apart["goodput"] == pytest.approx((250 / 35) / (300 / 30))  # each over its own window
    with pytest.raises(ValueError, match="committed nothing"):
        gf.common_window({"a": free, "b": []})
    with pytest.raises(ValueError, match="do not overlap"):
        gf.common_window({"a": free[:2], "b": [(30.0, 1, 0, 1), (40.0, 1, 1, 2)]})


def test_downtime_is_from_the_last_step_before_a_kill_to_the_first_after():
    traces = {2: [1.0, 2.0, 3.0, 3.55, 30.0, 31.0], 5: [1.0, 2.0]}
    # group 2's step at 3.55 s: the dying process's last, started between the decision and the signal
    assert gf.downtimes([(3.5, 2), (1.2, 5), (10.0, 5)], traces) == [27.0, 1.0]  # group 5 never came back


def test_ledger_counts_name_samples_twice_and_left_out():
    assert gf.ledger_counts({0: [(0, 10), (10, 20)], 1: [(0, 5)]}) == {"committed": 25, "twice": 0, "left_out": 0}
    assert gf.ledger_counts({0: [(0, 10), (5, 20)], 1: [(5, 8)]}) == {"committed": 28, "twice": 5, "left_out": 5}


def test_intervals_parse_and_bad_ones_say_why():
    assert gf.parse_intervals("10, 30,none") == [10.0, 30.0, None]
    for bad in ("", "0", "-5", "nan", "soon"):
        with pytest.raises(ValueError):
            gf.parse_intervals(bad)


def old_pair(interval: float) -> dict:
    return {"interval_s": interval, "goodput": 0.5, "downtime_share": 0.1, "stall_share": 0.0,
            "eval_loss_vs_free_at_equal_steps": 0.0, "fault_job": {"kills": 1, "samples_twice": 0, "samples_left_out": 0}}


def test_the_case_drills_only_the_faulty_job_of_each_pair_and_keeps_other_intervals_from_before(tmp_path):
    """case_faults with a stand-in for run_jobs: what it asks to run, and the section it builds."""
    import argparse

    asked = []

    def fake_run_jobs(args, jobs, *, configure, record, timeout_s):
        asked.append(jobs)
        out = {}
        for name, kw in jobs.items():
            per_s = 90 if "chaos" in kw else 100  # samples per second committed
            out[name] = {"commits": [(float(t), 0, t * per_s, (t + 1) * per_s) for t in range(1, 11)],
                         "eval_loss": 2.0, "committed_tokens": 10 * per_s * 32, "tokens_per_sample": 32,
                         "kills": 3 if "chaos" in kw else 0, "downtime_s_per_kill": [4.0, 5.0],
                         "stall_s_sum": 0.9, "samples_twice": 0, "samples_left_out": 0}
        return out

    saved = []
    args = argparse.Namespace(groups=4, intervals="10,none", faults=3, fault_steps=0, pace_ms=50.0, fault_h=20,
                              round_seconds=0.0, quorum_grace=1.0, heartbeat_timeout=3.0, collective_timeout=10.0,
                              together=True, equal_tokens=False, seed=7, job_timeout=60, plot=None, kinds="kill,stall",
                              stall_seconds=6.0, save=saved.append, previous={"pairs": [old_pair(60.0), old_pair(10.0)]})
    section = gf.case_faults(args, fake_run_jobs)
    assert [sorted(j) for j in asked] == [["every-10s", "twin-10s"], ["every-none", "twin-none"]]
    drill = asked[0]["every-10s"]["chaos"]
    assert drill["kinds"] == ["kill", "stall"] and drill["stall_s"] == [6.0, 6.0]
    assert asked[0]["every-10s"]["chaos"]["gap_s"] == [10.0, 10.0] and "chaos" not in asked[0]["twin-10s"]
    assert "chaos" not in asked[1]["every-none"]
    assert asked[0]["every-10s"]["steps"] == asked[0]["twin-10s"]["steps"] == 1240  # (3 x 10 / 0.95 + 30) s / 50 ms
    assert [p["interval_s"] for p in section["pairs"]] == [60.0, 10.0, None]  # the old 10 s pair replaced
    assert section["summary"]["10s"]["goodput"] == pytest.approx(0.9)
    assert section["summary"]["none"]["goodput"] == pytest.approx(1.0)
    assert section["pairs"][1]["downtime_share"] == pytest.approx(9.0 / (4 * 9))  # window (1, 10]: 9 s
    assert len(saved) == 2
