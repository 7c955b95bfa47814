"""Resumable data: the demo's samplers as data sources (position = a counter, state round trip, each
window once per epoch), the committed-position table, and the ledger check."""

import json

import numpy as np
import pytest
import torch
import torch.nn as nn
from diloco_helpers import position_records

from diloco.demo import data
from diloco.exchange.data_positions import (
    DataPositions,
    PositionError,
    check_ledger,
    ledger_from_logs,
    merged,
)
from diloco.job.data_source import DataSourceError, is_data_source, position, seek
from diloco.job.task import Task
from diloco.runtime.launch import summary
from diloco.runtime.ops import logs

TOKENS = np.random.default_rng(0).integers(0, 256, 2001).astype(np.uint8)  # 250 windows of 8


def windows_of(batch: tuple[torch.Tensor, torch.Tensor], block: int = 8) -> list[int]:
    """Which disjoint window each row of a batch is (its first input token's offset / block)."""
    x, y = batch
    starts = []
    for row, target in zip(x.numpy(), y.numpy()):
        matches = [w for w in range(len(TOKENS) // block) if np.array_equal(TOKENS[w * block: w * block + block], row)]
        w = matches[0] if len(matches) == 1 else None
        assert w is not None and np.array_equal(TOKENS[w * block + 1: w * block + block + 1], target)
        starts.append(matches[0])
    return starts


def test_epoch_sampler_trains_each_window_once_per_epoch_and_the_ranks_split_every_step():
    ranks = [data.EpochSampler(TOKENS, 5, 8, seed=11, rank=r, group_size=2) for r in range(2)]
    assert ranks[0].windows == 250 and ranks[0].samples_per_step == 10 and is_data_source(ranks[0])
    seen = []
    for _ in range(25):  # 25 steps x 2 ranks x 5 = 250 samples: one epoch
        seen += windows_of(next(ranks[0])) + windows_of(next(ranks[1]))
    assert sorted(seen) == list(range(250))  # no window twice, none left out
    assert seen == [ranks[0].window(i) for i in range(250)]  # rank r takes slice r of each step
    second = [w for _ in range(25) for w in windows_of(next(ranks[0])) + windows_of(next(ranks[1]))]
    assert sorted(second) == list(range(250)) and second != seen  # a fresh permutation per epoch


def test_epoch_sampler_state_round_trips_through_json_and_seeks():
    a = data.EpochSampler(TOKENS, 4, 8, seed=3, rank=1, group_size=3)
    for _ in range(7):
        next(a)
    state = json.loads(json.dumps(a.state()))
    assert state["samples"] == 7 * 12 == position(a)
    expected = [next(a) for _ in range(30)]  # crosses the epoch boundary at 250
    b = data.EpochSampler(TOKENS, 4, 8, seed=3, rank=1, group_size=3)
    b.load_state(state)
    again = [next(b) for _ in range(30)]
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(expected, again))
    seek(b, 12 * 7)
    assert torch.equal(next(b)[0], expected[0][0])
    with pytest.raises(data.DataError, match="this sampler is"):
        data.EpochSampler(TOKENS, 4, 8, seed=4, rank=1, group_size=3).load_state(state)
    with pytest.raises(DataSourceError, match="multiples of samples_per_step=12"):
        seek(b, 13)


def test_random_sampler_seeks_by_replaying_and_still_reads_old_checkpoints():
    a = data.BatchSampler(TOKENS, 4, 8, seed=5, group_size=2)
    old = a.state_dict()
    first = [next(a) for _ in range(6)]
    assert a.state()["samples"] == 6 * 8
    b = data.BatchSampler(TOKENS, 4, 8, seed=5, group_size=2)
    seek(b, 3 * 8)
    assert torch.equal(next(b)[0], first[3][0])
    c = data.BatchSampler(TOKENS, 4, 8, seed=5, group_size=2)
    c.load_state(old)  # a state_dict() of the format before data sources
    assert torch.equal(next(c)[0], first[0][0])
    with pytest.raises(data.DataError, match="not a multiple of 8"):
        b.load_state({**b.state(), "samples": 5})


def test_a_task_takes_a_data_source_position_for_its_checkpoints():
    source = data.EpochSampler(TOKENS, 4, 8, seed=3)
    task = Task(model=nn.Linear(1, 1), train_batches=source, loss=lambda m, b: b)
    next(source)
    assert task.data_state() == source.state() and task.data_state()["samples"] == 4
    plain = Task(model=nn.Linear(1, 1), train_batches=iter(()), loss=lambda m, b: b)
    assert plain.data_state is None


def test_the_table_counts_committed_weights_once_per_round_and_the_least_fragment():
    pos = DataPositions(group=1, tokens_per_step=2.0)  # a group of 2 ranks: weight = steps x 2
    pos.fragments, pos.samples_per_step = 2, 8
    pos.commit("f0/r0", {0: 8.0, 1: 8.0, 2: 0.0})
    assert pos.committed_steps() == 0 and pos.ledger == []  # fragment 1 has not committed these steps
    pos.commit("f1/r0", {0: 8.0, 1: 8.0})
    assert pos.committed_steps() == 4 and pos.ledger == [(0, 32)]
    pos.commit("f1/r0", {0: 8.0, 1: 8.0})  # counted already (a donor's table may hold it)
    pos.commit("f0/final", {1: 99.0})  # a control exchange carries no data
    assert pos.committed_steps() == 4
    pos.commit("f0/r1", {0: 8.0, 1: 0.0}, refused=True)
    pos.commit("f1/r1", {0: 8.0, 1: 0.0}, refused=True)
    assert pos.committed_steps() == 4 and pos.take_refused() and not pos.take_refused()
    assert pos.committed_steps(0) == 8  # another group's, in this group's steps
    healer = DataPositions(group=1, tokens_per_step=2.0)
    healer.fragments = 2  # as its engine says (QuorumAverager.attach)
    healer.load_state(json.loads(json.dumps(pos.state())))
    assert healer.committed_steps() == 4 and healer.state() == pos.state()
    with pytest.raises(PositionError, match="committed"):
        healer.load_state({"committed": "x", "rounds": []})
    with pytest.raises(PositionError, match="no data-position table"):
        healer.load_state(None)
    pos.commit("f0/r2", {1: 3.0})  # 1.5 steps: weights that are no whole number of steps are an error
    with pytest.raises(PositionError, match="whole number of steps"):
        pos.commit("f1/r2", {1: 3.0})


def test_check_ledger_names_samples_counted_twice_and_left_out():
    report = check_ledger({0: [(0, 10), (10, 20)], 1: [(0, 10), (5, 15), (20, 30)], 2: []})
    assert report[0].ok and report[0].counted == 20 and report[0].end == 20
    assert report[1].twice == [(5, 10)] and report[1].gaps == [(15, 20)] and not report[1].ok
    assert report[2].ok and report[2].end == 0
    assert merged([(0, 4), (4, 8), (6, 9), (12, 14)]) == [[0, 8], [6, 9], [12, 14]]


def test_the_ledger_is_read_back_from_worker_logs_of_rank_0_in_text_and_json():
    with position_records() as records:
        for rank in (0, 1):
            pos = DataPositions(group=3, tokens_per_step=1.0)
            pos.samples_per_step = 4
            pos.commit("f0/r0", {3: 2.0})
            pos.commit("f0/r1", {3: 0.0}, refused=True)
            pos.commit("f0/r2", {3: 1.0})
            for r in records[-2:]:
                r.component, r.group, r.rank = "worker", 3, rank
    for formatter in (logs.TextFormatter(), logs.JsonFormatter()):
        lines = [formatter.format(r) for r in records] + ["unrelated line", "{not json committed data"]
        assert ledger_from_logs(lines) == {3: [(0, 8), (8, 12)]}  # rank 1's copies are not counted again


def test_a_healer_logs_its_groups_last_advances_again_and_the_ledger_counts_each_commit_once():
    """Group 1's process saw rounds 0 and 1 commit, then died (or froze and was evicted) after its
    round-2 contribution committed but before it saw the commit: its log never says so. The healer
    takes the donor's table, which kept group 1's last advances, and logs them again; a range
    logged twice for the same exchange counts once."""
    with position_records() as records:
        donor, dead = DataPositions(group=0, tokens_per_step=1.0), DataPositions(group=1, tokens_per_step=2.0)
        donor.samples_per_step, dead.samples_per_step = 4, 8
        for r in range(3):
            donor.commit(f"f0/r{r}", {0: 2.0, 1: 4.0})
            if r < 2:
                dead.commit(f"f0/r{r}", {0: 2.0, 1: 4.0})
        dead_lines = len(records)
        healer = DataPositions(group=1, tokens_per_step=2.0)
        healer.samples_per_step = 8
        healer.load_state(json.loads(json.dumps(donor.state())))
        assert healer.committed_samples() == 48
        healer.log_inherited()
        inherited = len(records)
        healer.commit("f0/r3", {0: 2.0, 1: 4.0})
    for r in records:
        r.component, r.group, r.rank = "worker", r.data_group, 0
    for formatter in (logs.TextFormatter(), logs.JsonFormatter()):
        lines = [formatter.format(r) for r in records]
        without = lines[:dead_lines] + lines[inherited:]  # the dead process's lines and the healer's next commit
        assert check_ledger(ledger_from_logs(without))[1].gaps == [(32, 48)]
        ledger = ledger_from_logs(lines)
        assert ledger[1] == [(0, 16), (16, 32), (32, 48), (48, 64)] and check_ledger(ledger)[1].ok
    assert any("from the donor's table" in r.getMessage() for r in records[dead_lines:inherited])
    with pytest.raises(PositionError, match="advance"):
        healer.load_state({**donor.state(), "advances": [[1, 0.0, 4.0, "checkpoint/8"]]})
    older = {k: v for k, v in donor.state().items() if k != "advances"}  # a table of an older version
    healer.load_state(older)
    assert healer.committed_samples() == 48


def test_diloco_run_counts_each_groups_committed_data_from_every_incarnations_log(tmp_path):
    line = "2026-01-01T00:00:00.000Z INFO diloco.exchange.data_positions [worker group {g} rank {r}] group {g} " \
           "committed data samples [{a}, {b}) at f0/r1"
    lines = [line.format(g=0, r=r, a=a, b=a + 8) for a in (0, 8) for r in (0, 1)]
    (tmp_path / "group-0.log").write_text("\n".join(lines))
    (tmp_path / "group-1.log").write_text(line.format(g=1, r=0, a=0, b=8) + "\nother\n")
    (tmp_path / "group-1.restart-1.log").write_text(line.format(g=1, r=0, a=4, b=16))  # 4 samples twice
    (tmp_path / "group-1.restart-2.log").write_text(line.format(g=1, r=0, a=20, b=24))  # 4 left out
    counts = summary.data_counts(tmp_path)
    assert counts == {0: {"committed": 16, "twice": 0, "left_out": 0}, 1: {"committed": 24, "twice": 4, "left_out": 4}}


def test_a_resume_after_the_job_was_lost_drops_the_lost_commits_from_the_ledger():
    """Group 0 committed rounds 0-3 and checkpointed after round 1; then every group was lost. The
    resumed job continues from the checkpoint's table: rounds 2 and 3 were lost with the job, so
    their samples are trained again (as rounds 2-4, the first of them refused this time, which
    shifts the ranges). The ledger counts each sample once only if it drops the lost rounds."""
    with position_records() as records:
        first = DataPositions(group=0, tokens_per_step=1.0)
        first.samples_per_step = 4
        for r in range(4):
            first.commit(f"f0/r{r}", {0: 2.0, 1: 2.0})
            if r == 1:
                checkpoint = json.loads(json.dumps(first.state()))
        resumed = DataPositions(group=0, tokens_per_step=1.0)
        resumed.samples_per_step = 4
        resumed.load_state(checkpoint)
        resumed.log_resumed()
        resumed.commit("f0/r2", {0: 2.0, 1: 2.0})  # the same range as the lost round 2: counted again
        resumed.commit("f0/r3", {0: 0.0, 1: 2.0}, refused=True)
        resumed.commit("f0/r4", {0: 2.0, 1: 2.0})
    for r in records:
        r.component, r.group, r.rank = "worker", r.data_group, 0
    for formatter in (logs.TextFormatter(), logs.JsonFormatter()):
        lines = [formatter.format(r) for r in records]
        ledger = ledger_from_logs(lines)
        assert ledger[0] == [(0, 8), (8, 16), (16, 24), (24, 32)], ledger
        assert check_ledger(ledger)[0].ok and check_ledger(ledger)[0].end == resumed.committed_samples() == 32
        resume_line = next(line for line in lines if "resumed" in line)
        without = [line for line in lines if line != resume_line]  # what the ledger read before
        assert check_ledger(ledger_from_logs(without))[0].twice == [(24, 32)]  # lost r3, trained again in r4
