"""The job's summary built from the groups' summaries (pure, torch-free)."""

import json
import math

import pytest

from diloco.coordinator.report import format_job_summary, job_summary


def group_summary(group: int, param_hash: str = "sha256:aa", **extra) -> dict:
    """A group summary with the keys diloco.runtime.rank.worker sends (values made up)."""
    return {
        "group": group, "eval_loss": 2.5 + 0.1 * group, "initial_eval_loss": 5.4927,
        "final_train_loss": 2.4, "round_hashes": [param_hash], "outer_rounds": 10,
        "inner_steps": 300, "periods": [30] * 10, "bytes_sent": 1_000_000 + group,
        "bytes_received": 999_000, "param_hash": param_hash, "num_parameters": 437_760,
        "tokens": 10_000, "seconds": 50.0 + group, "compute_seconds": 45.0,
        "sync_seconds": 5.0, "utilization": 0.9 - 0.1 * group, "mode": "blocking",
        "fragments": 1, **extra,
    }


def test_identical_groups():
    job = job_summary({0: group_summary(0), 1: group_summary(1)})
    assert job["groups"] == 2 and job["group_ids"] == [0, 1]
    assert job["eval_loss"] == 2.5 and job["eval_loss_per_group"] == {0: 2.5, 1: 2.6}
    assert job["eval_loss_mean"] == pytest.approx(2.55)
    assert job["initial_eval_loss"] == 5.4927
    assert (job["outer_rounds"], job["inner_steps"], job["mode"], job["fragments"]) == (
        10, 300, "blocking", 1)
    assert job["bytes_sent"] == 2_000_001 and job["bytes_received"] == 1_998_000
    assert job["tokens"] == 20_000 and job["num_parameters"] == 437_760
    assert job["seconds"] == 51.0 and job["utilization"] == pytest.approx(0.8)
    assert job["params_identical"] is True
    assert job["param_hash_per_group"] == {0: "sha256:aa", 1: "sha256:aa"}
    assert job["ok"] and job["problems"] == [] and job["notes"] == [] and job["failed_groups"] == []
    text = format_job_summary(job)
    assert text.startswith("diloco job summary\n")
    assert "eval loss (global model) : 2.5000 nats/token (initial 5.4927)" in text
    assert "eval loss per group      : 2.5000, 2.6000 (mean 2.5500)" in text
    assert "global params identical  : True (sha256:aa, sha256:aa)" in text
    assert "bytes between groups     : 2.0MB (2,000,001 B) sent" in text
    assert "wall time                : 51.0 s" in text
    assert "compute utilization      : 80.0%" in text
    assert "disagree" not in text
    json.loads(json.dumps(job))  # JSON-able


LATE = {"group": 0, "rank": 0, "joined_late": True,
        "reason": "group 0: the job's groups finished before this group could heal"}


def test_the_initial_loss_comes_from_a_group_that_measured_it():
    """Group 0 healed into the job (a resume with it behind): it measured no initial loss (NaN)."""
    job = job_summary({0: group_summary(0, initial_eval_loss=math.nan), 1: group_summary(1)})
    assert job["initial_eval_loss"] == 5.4927
    job = job_summary({0: group_summary(0, initial_eval_loss=math.nan)})
    assert math.isnan(job["initial_eval_loss"])


def test_a_group_told_it_joined_too_late_is_left_out_of_the_figures():
    """The replayed cluster's case: group 0 restarted and asked to heal after group 1 finished."""
    job = job_summary({0: LATE, 1: group_summary(1, "sha256:bb")}, joined_late=[0])
    assert job["ok"] and job["problems"] == [] and job["notes"] == []
    assert job["groups"] == 2 and job["group_ids"] == [0, 1] and job["model_group_ids"] == [1]
    assert job["late_groups"] == {0: repr(LATE["reason"])}
    assert job["params_identical"] is True and job["param_hash_per_group"] == {1: "sha256:bb"}
    assert job["eval_loss"] == 2.6 and job["eval_loss_per_group"] == {1: 2.6}  # group 1's: the global model
    assert (job["outer_rounds"], job["inner_steps"], job["bytes_sent"]) == (10, 300, 1_000_001)
    text = format_job_summary(job)
    assert "global params identical  : True (sha256:bb)" in text
    assert "groups                   : 2 (0, 1)" in text
    assert "joined too late          : group 0 (\"group 0: the job's groups finished" in text
    assert "disagree" not in text and "n/a" not in text


def test_a_late_join_the_coordinator_did_not_tell_is_a_problem():
    """A group's own word that it holds no model does not clear it: it might hide a diverged one."""
    job = job_summary({0: LATE, 1: group_summary(1)})
    assert not job["ok"] and job["model_group_ids"] == [1] and job["params_identical"] is True
    assert job["problems"] == ["group 0 says it joined too late, but the coordinator never told it the job had "
                               "finished: whether it holds a model that differs is unknown"]


def test_every_group_late_is_a_problem():
    job = job_summary({0: LATE, 1: {**LATE, "group": 1}}, joined_late=[0, 1])
    assert not job["ok"] and job["params_identical"] is None and job["eval_loss"] is None
    assert job["problems"] == ["no group trained to the end: every group joined too late ([0, 1])"]
    assert "global params identical  : unknown ()" in format_job_summary(job)


def test_a_summary_without_the_late_flag_still_needs_its_hash():
    """Only ``joined_late: True`` leaves a group out; a truthy string or a told group that then
    trained on and reported a real summary is held to the hash check."""
    job = job_summary({0: {**group_summary(0), "param_hash": "", "joined_late": "yes"},
                       1: group_summary(1)}, joined_late=[0])
    assert job["model_group_ids"] == [0, 1] and job["params_identical"] is None and not job["ok"]


def test_diverged_hashes_are_a_problem():
    job = job_summary({0: group_summary(0, "sha256:aa"), 1: group_summary(1, "sha256:bb")})
    assert job["params_identical"] is False and not job["ok"]
    assert job["problems"] == ["the groups' global parameters diverged: group 0 sha256:aa, "
                               "group 1 sha256:bb"]
    assert "global params identical  : False, DIVERGED (sha256:aa, sha256:bb)" in (
        format_job_summary(job))


def test_missing_keys_and_wrong_types_are_left_out_and_noted():
    summaries = {0: group_summary(0, eval_loss="low", outer_rounds=True, bytes_sent=None),
                 1: {"seconds": 3}, 2: group_summary(2, param_hash="")}
    job = job_summary(summaries)
    assert job["eval_loss"] is None and job["eval_loss_per_group"] == {0: None, 1: None, 2: 2.7}
    assert job["eval_loss_mean"] == pytest.approx(2.7)
    assert job["outer_rounds"] is None and job["outer_rounds_per_group"] == {0: None, 1: None,
                                                                            2: 10}
    assert job["bytes_sent"] == 1_000_002 and job["seconds"] == 52.0
    assert job["params_identical"] is None and not job["ok"]
    assert job["problems"] == ["cannot tell whether the global parameters are identical: "
                               "no param_hash from groups [1, 2]"]
    assert sorted(job["notes"]) == [
        "group 0: bytes_sent None is not of type int; left out",
        "group 0: eval_loss 'low' is not a number; left out",
        "group 0: outer_rounds True is not of type int; left out",
        "group 2: param_hash is empty; left out",
    ]
    text = format_job_summary(job)
    assert "eval loss (global model) : n/a nats/token" in text
    assert "outer rounds             : n/a (groups disagree: 0: n/a, 1: n/a, 2: 10)" in text
    assert "global params identical  : unknown (sha256:aa, None, None)" in text
    assert "  note: group 0: eval_loss 'low' is not a number; left out" in text


def test_a_group_with_nothing_useful_formats():
    job = job_summary({0: {}, 1: {"param_hash": ["not", "a", "str"] * 50}})
    text = format_job_summary(job)
    assert "bytes between groups     : n/a sent, n/a received" in text
    assert "wall time                : n/a s" in text
    note = job["notes"][0]
    assert note.startswith("group 1: param_hash ['not', 'a'") and "..." in note
    assert len(note) < 150  # untrusted values are shortened


def test_failed_groups_are_a_problem():
    job = job_summary({0: group_summary(0), 1: group_summary(1, failed="rank 1: NaN loss")})
    assert job["failed_groups"] == [1] and not job["ok"]
    assert job["problems"] == ["group 1 reported failure: 'rank 1: NaN loss'"]
    assert "failed groups            : 1" in format_job_summary(job)
    assert job_summary({0: group_summary(0, failed=False)})["ok"]


def test_nan_loss_is_kept():
    job = job_summary({0: group_summary(0, eval_loss=float("nan"))})
    assert math.isnan(job["eval_loss"])
    assert "eval loss (global model) : nan nats/token" in format_job_summary(job)


def test_disagreeing_groups_are_shown():
    job = job_summary({0: group_summary(0), 1: group_summary(1, outer_rounds=11,
                                                               mode="streaming")})
    text = format_job_summary(job)
    assert "outer rounds             : 10 (groups disagree: 0: 10, 1: 11)" in text
    assert "sync mode                : blocking (groups disagree: 0: blocking, 1: streaming)" in text


def test_no_summaries_is_an_error():
    with pytest.raises(ValueError, match="no group summaries"):
        job_summary({})
