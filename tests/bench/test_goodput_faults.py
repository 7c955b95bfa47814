"""bench/goodput_ledger.py and bench/goodput_faults.py: commit records read back from real worker log lines (each committed range
once, as the ledger counts it: a healer's re-logged rounds are not counted again), the common window,
goodput of a faulty job against its twin and its checks against the ledger, restart down-times, the
ledger's counts, interval parsing, repeats."""

import importlib
import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
gf = importlib.import_module("bench.goodput_faults")
gl = importlib.import_module("bench.goodput_ledger")

from diloco.exchange.data_positions import DataPositions, ledger_from_logs
from diloco.runtime.ops.logs import JsonFormatter, TextFormatter


def at(t: float):
    """A log line's time: written to the millisecond (pytest.approx's default would allow half an hour)."""
    return pytest.approx(t, abs=0.002)


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
    commits = gl.commits_from_logs(lines)
    # 16 weight / 8 per step = 2 steps x 8 samples; then 1 step; a control exchange carries no data
    assert commits == [(at(t0), 3, 0, 16), (at(t0 + 1), 3, 16, 24)]


def test_goodput_counts_commits_in_the_common_window_only():
    free = [(10.0, 0, 0, 100), (20.0, 0, 100, 200), (30.0, 0, 200, 300), (40.0, 0, 300, 400)]
    fault = [(15.0, 1, 0, 100), (25.0, 1, 100, 150), (35.0, 1, 150, 250), (50.0, 1, 250, 350)]
    assert gl.common_window({"a": free, "b": fault}) == (15.0, 40.0)
    assert gl.committed_between(fault, 15.0, 40.0) == 150  # (15, 40]: the commit at 15 opened the window
    r = gl.pair_result({"commits": fault, "eval_loss": 2.02, "committed_tokens": 350 * 4},
                       {"commits": free, "eval_loss": 2.0, "committed_tokens": 400 * 4}, together=True,
                       tokens_per_sample=4)
    assert r["window_s"] == 25.0
    assert r["tokens_per_s"] == pytest.approx(150 * 4 / 25) and r["free_tokens_per_s"] == pytest.approx(300 * 4 / 25)
    assert r["goodput"] == pytest.approx(0.5)
    assert r["eval_loss_vs_free_at_equal_steps"] == pytest.approx(0.01)
    assert r["tokens_vs_free"] == pytest.approx(-0.125)
    apart = gl.pair_result({"commits": fault, "eval_loss": 1.0, "committed_tokens": 350 * 4},
                           {"commits": free, "eval_loss": 1.0, "committed_tokens": 400 * 4}, together=False,
                           tokens_per_sample=4)
    assert apart["goodput"] == pytest.approx((250 / 35) / (300 / 30))  # each over its own window
    with pytest.raises(ValueError, match="committed nothing"):
        gl.common_window({"a": free, "b": []})
    with pytest.raises(ValueError, match="do not overlap"):
        gl.common_window({"a": free[:2], "b": [(30.0, 1, 0, 1), (40.0, 1, 1, 2)]})


def test_downtime_is_from_the_last_step_before_a_kill_to_the_first_after():
    traces = {2: [1.0, 2.0, 3.0, 3.55, 30.0, 31.0], 5: [1.0, 2.0]}
    # group 2's step at 3.55 s: the dying process's last, started between the decision and the signal
    assert gl.downtimes([(3.5, 2), (1.2, 5), (10.0, 5)], traces) == [27.0, 1.0]  # group 5 never came back


def test_recovery_is_from_the_fault_to_the_groups_next_commit():
    commits = [(1.0, 2, 0, 8), (3.2, 2, 8, 16), (9.0, 0, 0, 8), (12.0, 2, 16, 24), (13.0, 2, 24, 32)]
    # group 2's commit at 3.2 s: the round it had finished when frozen at 3.0 s; group 5 never commits
    assert gl.recoveries([(3.0, 2), (2.0, 0), (4.0, 5)], commits) == [9.0, 7.0]


def test_ledger_counts_name_samples_twice_and_left_out():
    assert gl.ledger_counts({0: [(0, 10), (10, 20)], 1: [(0, 5)]}) == {"committed": 25, "twice": 0, "left_out": 0}
    assert gl.ledger_counts({0: [(0, 10), (5, 20)], 1: [(5, 8)]}) == {"committed": 28, "twice": 5, "left_out": 5}


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

    configures = []

    def fake_run_jobs(args, jobs, *, configure, record, timeout_s):
        asked.append(jobs)
        configures.append(configure)
        out = {}
        for name, kw in jobs.items():
            per_s = 90 if "chaos" in kw else 100  # samples per second committed
            out[name] = {"commits": [(float(t), 0, t * per_s, (t + 1) * per_s) for t in range(1, 11)],
                         "eval_loss": 2.0, "committed_tokens": 10 * per_s * 32, "tokens_per_sample": 32,
                         "kills": 3 if "chaos" in kw else 0, "downtime_s_per_kill": [4.0, 5.0],
                         "recovery_s_per_fault": [5.0, 6.0], "recovery_s_median": 5.5,
                         "stall_s_sum": 0.9, "samples_twice": 0, "samples_left_out": 0}
        return out

    saved = []
    args = argparse.Namespace(groups=4, intervals="10,none", faults=3, fault_steps=0, pace_ms=50.0, fault_h=20,
                              round_seconds=0.0, quorum_grace=1.0, heartbeat_timeout=3.0, collective_timeout=10.0,
                              together=True, equal_tokens=False, seed=7, job_timeout=60, plot=None, kinds="kill,stall",
                              stall_seconds=6.0, save=saved.append, previous={"pairs": [old_pair(60.0), old_pair(10.0)]})
    section = gf.case_faults(args, fake_run_jobs, "some.module:traced_task")
    assert [sorted(j) for j in asked] == [["every-10s", "twin-10s"], ["every-none", "twin-none"]]
    assert configures[0](args, trace=tmp_path / "trace", steps=100).train.entry == "some.module:traced_task"
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


# --- the numerator counts each committed range once (issue 46, point 5) --------------------------------

def logged(caplog, group: int, rank: int, created: float, action, formatter=None) -> list[str]:
    """The log lines ``action()`` makes DataPositions write, as a worker of ``group``/``rank`` writes
    them (its formatter, text by default), the n-th stamped ``created + n`` s."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diloco.exchange.data_positions"):
        action()
    lines = []
    for i, rec in enumerate(r for r in caplog.records if "committed data" in r.getMessage()):
        rec.component, rec.group, rec.rank, rec.created = "worker", group, rank, created + i
        lines.append((formatter or TextFormatter()).format(rec))
    return lines


def positions(group: int) -> DataPositions:
    pos = DataPositions(group, tokens_per_step=8.0)
    pos.samples_per_step = 8
    return pos


def healed_job_lines(caplog, t0: float, formatter=None) -> list[str]:
    """Group 3's first process sees rounds 0-3 commit (2 steps of 8 samples each: 16 samples a
    round) and dies after round 4 committed, before it saw it; group 5 (the donor) sees rounds 0-4;
    group 3's healer takes the donor's table, logs its group's last advances again (rounds 0-4:
    ``DataPositions.log_inherited``, the worker's own call at a heal), then sees round 5 commit."""
    weights = {3: 16.0, 5: 16.0}
    first, donor, healer = positions(3), positions(5), positions(3)
    lines = logged(caplog, 3, 0, t0, lambda: [first.commit(f"f0/r{r}", weights) for r in range(4)])
    lines += logged(caplog, 5, 0, t0, lambda: [donor.commit(f"f0/r{r}", weights) for r in range(5)])

    def heal():
        healer.load_state(donor.state())
        healer.log_inherited()
    lines += logged(caplog, 3, 0, t0 + 10, heal, formatter)
    lines += logged(caplog, 3, 0, t0 + 20, lambda: healer.commit("f0/r5", weights), formatter)
    lines += logged(caplog, 5, 0, t0 + 20, lambda: donor.commit("f0/r5", weights))
    return lines


@pytest.mark.parametrize("formatter", [None, JsonFormatter()], ids=["text", "json"])
def test_a_healers_relogged_rounds_count_once_at_their_first_line(caplog, formatter):
    t0 = 1_800_000_000.0
    lines = healed_job_lines(caplog, t0, formatter)
    relogs = [line for line in lines if "from the donor's table" in line]
    assert len(relogs) == 5  # rounds 0-4 of group 3 logged again: 4 of them were logged already
    commits = gl.commits_from_logs(lines)
    group3 = [(t, a, b) for t, g, a, b in commits if g == 3]
    # rounds 0-3 at their commit lines; round 4 at the heal (its first line); round 5 after it
    assert group3 == [(at(t0 + r), 16 * r, 16 * (r + 1)) for r in range(4)] + [
        (at(t0 + 10 + 4), 64, 80), (at(t0 + 20), 80, 96)]
    assert sum(b - a for _, g, a, b in commits if g == 5) == 96
    ranges = ledger_from_logs(lines)
    gl.check_numerator(commits, ranges)  # the numerator sums to the ledger, group by group
    assert gl.ledger_counts(ranges) == {"committed": 192, "twice": 0, "left_out": 0}


def test_the_window_holds_no_more_than_the_job_committed_and_the_bench_says_so_otherwise(caplog):
    t0 = 1_800_000_000.0
    lines = healed_job_lines(caplog, t0)
    commits = gl.commits_from_logs(lines)
    committed = gl.ledger_counts(ledger_from_logs(lines))["committed"] * 32
    free = [(t0 - 1 + i, 0, 16 * i, 16 * (i + 1)) for i in range(40)]
    r = gl.pair_result({"commits": commits, "eval_loss": 1.0, "committed_tokens": committed},
                       {"commits": free, "eval_loss": 1.0, "committed_tokens": 40 * 16 * 32}, together=True,
                       tokens_per_sample=32)
    assert r["tokens_in_window"] <= committed
    # every commit after the window's start (t0): all but the first of each group
    assert r["tokens_in_window"] == (192 - 32) * 32
    # the numerator as it was: every committed-range line, a healer's again-logged rounds included
    every_line = sorted((t, g, a, b) for t, g, a, b in (
        (gl._line_time(line), *gf._ledger_record(line)[:3]) for line in lines))
    assert len(every_line) == len(commits) + 4
    with pytest.raises(gl.CountError, match="counted twice"):
        gl.pair_result({"commits": every_line, "eval_loss": 1.0, "committed_tokens": committed},
                       {"commits": free, "eval_loss": 1.0, "committed_tokens": 40 * 16 * 32}, together=True,
                       tokens_per_sample=32)
    with pytest.raises(gl.CountError, match="numerator and the ledger disagree, .* 3: \\(160, 96\\)"):
        gl.check_numerator(every_line, ledger_from_logs(lines))
    with pytest.raises(gl.CountError, match="5: \\(0, 96\\)"):  # a group the numerator lacks
        gl.check_numerator([c for c in commits if c[1] != 5], ledger_from_logs(lines))


def test_a_resume_drops_the_rounds_after_its_checkpoint_from_the_numerator_as_from_the_ledger(caplog):
    t0 = 1_800_000_000.0
    weights = {3: 16.0}
    before, resumed = positions(3), positions(3)
    saved = {}

    def run():
        for r in range(4):
            before.commit(f"f0/r{r}", weights)
            if r == 1:
                saved.update(before.state())  # the checkpoint holds rounds 0-1
    lines = logged(caplog, 3, 0, t0, run)

    def resume():
        resumed.load_state(saved)
        resumed.log_resumed()
        for r in (2, 3):
            resumed.commit(f"f0/r{r}", weights)
    lines += logged(caplog, 3, 0, t0 + 10, resume)
    commits = gl.commits_from_logs(lines)
    # rounds 2-3 of the job before the resume were lost with it; their ranges count from their commits after it
    assert commits == [(at(t0), 3, 0, 16), (at(t0 + 1), 3, 16, 32),
                       (at(t0 + 11), 3, 32, 48), (at(t0 + 12), 3, 48, 64)]
    assert [(a, b) for _, _, a, b in commits] == ledger_from_logs(lines)[3]


def test_a_committed_range_line_without_a_time_is_an_error_not_skipped():
    line = "[worker group 3 rank 0] group 3 committed data samples [0, 16) at f0/r0"
    with pytest.raises(gl.CountError, match="without a readable time"):
        gl.commits_from_logs([line])


def test_repeats_run_each_intervals_pair_again_and_the_summary_spans_them():
    import argparse

    asked = []

    def fake_run_jobs(args, jobs, *, configure, record, timeout_s):
        asked.append(sorted(jobs))
        per_s = 80 + 10 * len(asked) if any("chaos" in kw for kw in jobs.values()) else 100
        return {name: {"commits": [(float(t), 0, t * (per_s if "chaos" in kw else 100), (t + 1) * (per_s if "chaos"
                                   in kw else 100)) for t in range(1, 11)],
                       "eval_loss": 2.0, "committed_tokens": 11 * 100 * 32, "tokens_per_sample": 32,
                       "kills": 2 if "chaos" in kw else 0, "frozen": 1 if "chaos" in kw else 0,
                       "downtime_s_per_kill": [], "recovery_s_per_fault": [], "recovery_s_median": None, "stall_s_sum": 0.0, "samples_twice": 0, "samples_left_out": 0}
                for name, kw in jobs.items()}

    args = argparse.Namespace(groups=4, intervals="30", faults=3, fault_steps=0, pace_ms=50.0, fault_h=20,
                              round_seconds=0.0, quorum_grace=0.5, heartbeat_timeout=3.0, collective_timeout=10.0,
                              together=True, equal_tokens=False, seed=7, job_timeout=60, plot=None, kinds="kill,stall",
                              stall_seconds=6.0, repeats=2, save=lambda s: None, previous=None)
    section = gf.case_faults(args, fake_run_jobs, "bench.goodput:slow_task")
    assert asked == [["every-30s", "twin-30s"]] * 2
    assert [(p["interval_s"], p["repeat"]) for p in section["pairs"]] == [(30.0, 1), (30.0, 2)]
    summary = section["summary"]["30s"]
    assert summary["repeats"] == 2 and summary["goodput_per_repeat"] == [pytest.approx(0.9), pytest.approx(1.0)]
    assert summary["goodput"] == pytest.approx(0.95) and summary["goodput_min"] == pytest.approx(0.9)
    assert summary["faults_per_repeat"] == [3, 3]


def test_the_timed_ranges_must_be_the_ledgers_or_the_bench_stops(caplog, monkeypatch):
    lines = healed_job_lines(caplog, 1_800_000_000.0)
    real = gl.ledger_from_logs
    monkeypatch.setattr(gl, "ledger_from_logs", lambda ls: {g: r[:-1] for g, r in real(ls).items()})
    with pytest.raises(gl.CountError, match="group 3: the timed ranges \\(6\\) are not the ledger's \\(5\\)"):
        gl.commits_from_logs(lines)


def old_record(date: str, goodput: float, fault_heals: int, free_heals: int) -> dict:
    """A pair as case_faults wrote it before the numerator was the ledger (totals only)."""
    return {"interval_s": 30.0, "goodput": goodput, "window_s": 100.0, "tokens_per_s": 1010 * 32 / 100,
            "free_tokens_per_s": 1000 * 32 / 100, "settings": {"date": date},
            "fault_job": {"tokens_per_sample": 32, "committed_samples": 980, "heals": fault_heals},
            "free_job": {"tokens_per_sample": 32, "committed_samples": 1002, "heals": free_heals}}


def test_recount_says_which_old_figures_stand_and_bounds_the_others():
    before = gf.recount_pair(old_record("2026-11-26 05:10 UTC", 1.01, 20, 0))
    assert before["status"] == "exact"  # before healers re-logged: the numerator counted what the ledger did
    assert gf.recount_pair(old_record("2026-11-26 18:00 UTC", 1.01, 0, 0))["status"] == "exact"  # no heal
    after = gf.recount_pair(old_record("2026-11-26 18:00 UTC", 1.01, 20, 0))
    assert after["status"] == "bound" and after["fault_in_window"] == 1010 and after["free_in_window"] == 1000
    assert after["bound"] == pytest.approx(980 / 1000)  # every sample the ledger has, over the twin's window
    assert gf.recount_pair(old_record("2026-11-26 18:00 UTC", 0.9, 20, 0))["bound"] == pytest.approx(0.9)
    assert gf.recount_pair(old_record("2026-11-26 18:00 UTC", 1.01, 20, 5))["status"] == "withdrawn"
    counted = old_record("2026-11-28 16:00 UTC", 1.01, 20, 5)
    for job in ("fault_job", "free_job"):  # a record of the ledger's count says how many commit lines it read
        counted[job]["commit_lines"] = 1000
    assert gf.recount_pair(counted)["status"] == "exact"


def test_worker_logs_are_read_in_the_order_they_were_written():
    names = ["group-1.restart-10.log", "group-0.log", "group-1.restart-2.log", "group-1.log", "group-0.restart-1.log"]
    ordered = sorted((Path(n) for n in names), key=gf.log_order)
    assert [p.name for p in ordered] == ["group-0.log", "group-0.restart-1.log", "group-1.log",
                                         "group-1.restart-2.log", "group-1.restart-10.log"]
    with pytest.raises(ValueError, match="worker log"):
        gf.log_order(Path("spare-0.log"))
