"""The pure quorum, vote and screen rules (diloco.coordinator.rounds), no processes."""

import math

import pytest

from diloco.coordinator.rounds import (
    HEAL,
    LATE,
    STOPPED,
    TRAINED,
    Ask,
    Disagreement,
    Quorum,
    commit_outcome,
    decide,
    job_finished,
    own_share,
    screen,
    summary_kind,
    trained_groups,
    weighted_scale,
)


def ask(exchange=5, tag="f0/r5", numel=100, weight=10.0, state_hash="h1", norm=1.0, healable=True, setting=""):
    return Ask(exchange, tag, numel, weight, state_hash, norm, healable, setting)


def test_a_quorum_waits_for_every_live_group_then_forms():
    asks = {0: ask(), 1: ask()}
    assert decide(asks, {0, 1, 2}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q") is None
    q = decide({**asks, 2: ask()}, {0, 1, 2}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q")
    assert q.groups == (0, 1, 2) and q.exchange == 5 and q.tag == "f0/r5" and q.numel == 100
    assert dict(q.weights) == {0: 10.0, 1: 10.0, 2: 10.0} and q.healers == () and q.donor == -1


def test_a_failed_group_is_not_waited_for_and_min_groups_pauses_the_survivors():
    asks = {0: ask()}
    q = decide(asks, {0}, next_exchange=5, min_groups=1, attempt=1, quorum_id="q")
    assert q.groups == (0,) and q.attempt == 1
    assert decide(asks, {0}, next_exchange=5, min_groups=2, attempt=1, quorum_id="q") is None


def test_healers_join_with_weight_zero_and_a_member_that_turns_with_the_exchange_donates():
    asks = {1: ask(), 2: ask(), 0: Ask(HEAL)}
    q = decide(asks, {1, 2}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q")
    assert q.groups == (0, 1, 2) and q.healers == (0,) and q.donor == 2  # members [1, 2], exchange 5: the second
    q6 = decide({1: ask(exchange=6), 2: ask(exchange=6), 0: Ask(HEAL)}, {1, 2}, next_exchange=6, min_groups=1,
                attempt=0, quorum_id="q")
    assert q6.donor == 1  # the next exchange, the other member: a donor that never serves holds no healer out
    assert q.weights[0] == 0.0 and q.contributors == (1, 2)
    # a control exchange (the initial check) takes no healers: they wait for the next one
    asks = {1: ask(healable=False), 2: ask(healable=False), 0: Ask(HEAL)}
    q = decide(asks, {1, 2}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q")
    assert q.groups == (1, 2) and q.healers == ()
    # healers alone cannot form a quorum: nobody holds the state
    assert decide({0: Ask(HEAL)}, set(), next_exchange=5, min_groups=1, attempt=0, quorum_id="q") is None


def test_a_control_exchange_counts_the_waiting_healers_towards_min_groups():
    """A job resumed with group 0 behind: it waits to heal at the next training exchange while the
    others run the initial check. With --min-groups 2 the check must not wait for it (it never
    takes part in a control exchange), else each waits for the other."""
    control = {1: ask(exchange=0, healable=False), 0: Ask(HEAL)}
    q = decide(control, {1}, next_exchange=0, min_groups=2, attempt=0, quorum_id="q")
    assert q is not None and q.groups == (1,) and q.healers == ()
    assert decide({1: ask(exchange=0, healable=False)}, {1}, next_exchange=0, min_groups=2, attempt=0, quorum_id="q") is None
    # a healer not asking yet (it waits to learn the job's --codec/--h auto setting), heard from, counts too
    q = decide({1: ask(exchange=0, healable=False)}, {1}, next_exchange=0, min_groups=2, attempt=1, quorum_id="q",
               healing={0})
    assert q is not None and q.groups == (1,) and q.attempt == 1
    training = {1: ask(exchange=1), 0: Ask(HEAL)}
    q = decide(training, {1}, next_exchange=1, min_groups=2, attempt=0, quorum_id="q")
    assert q.groups == (0, 1) and q.healers == (0,)
    assert decide(training, {1}, next_exchange=1, min_groups=3, attempt=0, quorum_id="q") is None
    # a training exchange counts only the healers that asked: they take part in it
    assert decide({1: ask(exchange=1)}, {1}, next_exchange=1, min_groups=2, attempt=0, quorum_id="q",
                  healing={0}) is None


def test_a_group_with_another_state_hash_or_exchange_is_evicted_by_the_majority():
    asks = {0: ask(), 1: ask(state_hash="bad"), 2: ask(), 3: ask(exchange=4)}
    q = decide(asks, {0, 1, 2, 3}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q")
    assert q.groups == (0, 2)
    assert "hash bad differs" in q.evicted[1] and "exchange 4" in q.evicted[3]
    # a two-group tie evicts nobody, whichever group differs: the attempt is rolled back
    for first, second in (("a", "b"), ("b", "a")):
        d = decide({0: ask(state_hash=first), 1: ask(state_hash=second)}, {0, 1}, next_exchange=5, min_groups=1,
                   attempt=0, quorum_id="q")
        assert isinstance(d, Disagreement) and d.what == "global state hash" and dict(d.values) == {0: first, 1: second}
        assert "group 0" in d.message() and "group 1" in d.message() and "exchange 5" in d.message()
    # so does a tie between two pairs
    d = decide({0: ask(state_hash="a"), 1: ask(state_hash="b"), 2: ask(state_hash="a"), 3: ask(state_hash="b")},
               {0, 1, 2, 3}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q")
    assert isinstance(d, Disagreement)


def test_a_member_running_another_auto_setting_is_evicted_by_the_majority():
    """--codec/--h auto: every member decides the same setting; one that asks with another would
    exchange another codec's frames, so it is stopped and heals (learning the job's setting)."""
    asks = {0: ask(setting="slo-h30-d3"), 1: ask(setting="slo-h50-d3"), 2: ask(setting="slo-h30-d3")}
    q = decide(asks, {0, 1, 2}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q")
    assert q.groups == (0, 2) and q.setting == "slo-h30-d3"
    assert "slo-h50-d3" in q.evicted[1] and "slo-h30-d3" in q.evicted[1]
    # a tie evicts nobody; jobs without auto ask with none and agree
    d = decide({0: ask(setting="b"), 1: ask(setting="a")}, {0, 1}, next_exchange=5, min_groups=1, attempt=0,
               quorum_id="q")
    assert isinstance(d, Disagreement) and d.what == "auto setting"
    q = decide({0: ask(), 1: ask()}, {0, 1}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q")
    assert q.groups == (0, 1) and q.setting == "" and not q.evicted
    # a healer asks without one: it learns the quorum's
    q = decide({0: ask(setting="a"), 1: Ask(HEAL)}, {0}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q")
    assert q.healers == (1,) and q.setting == "a" and not q.evicted


def test_after_a_coordinator_restart_the_exchange_most_groups_ask_for_wins():
    asks = {0: ask(exchange=7, tag="f0/r7"), 1: ask(exchange=7, tag="f0/r7"), 2: ask(exchange=6, tag="f0/r6")}
    q = decide(asks, {0, 1, 2}, next_exchange=None, min_groups=1, attempt=0, quorum_id="q")
    assert q.exchange == 7 and q.groups == (0, 1) and 2 in q.evicted


def test_rejected_contributions_weigh_zero():
    q = decide({0: ask(), 1: ask()}, {0, 1}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q",
               rejected={1: "NaN"})
    assert q.weights == {0: 10.0, 1: 0.0} and q.rejected == {1: "NaN"} and q.groups == (0, 1)


def test_screen_refuses_non_finite_and_outlier_norms_only():
    assert screen(1.0, [], 10.0) is None
    assert "NaN" in screen(math.nan, [1.0] * 5, 10.0)
    assert "NaN/Inf" in screen(math.inf, [], 0.0)
    assert screen(50.0, [1.0, 1.0], 10.0) is None  # not enough history yet
    assert "limit 10x" in screen(50.0, [1.0, 2.0, 1.5], 10.0)
    assert screen(14.0, [1.0, 2.0, 1.5], 10.0) is None
    assert screen(1e9, [1.0, 2.0, 1.5], 0.0) is None  # the outlier rule off


def test_commit_needs_every_rank_of_every_member_and_any_failure_rolls_back():
    q = Quorum("q", 5, 0, "t", 10, (0, 1), {0: 1.0, 1: 1.0})
    sizes = {0: 2, 1: 1}
    ok = (True, "")
    assert commit_outcome(q, sizes, {(0, 0): ok, (1, 0): ok}, {}) is None
    assert commit_outcome(q, sizes, {(0, 0): ok, (0, 1): ok, (1, 0): ok}, {})[0] is True
    assert commit_outcome(q, sizes, {(0, 0): ok, (1, 0): (False, "peer lost")}, {}) == (
        False, "group 1 rank 0: peer lost")
    assert commit_outcome(q, sizes, {(0, 0): ok, (0, 1): ok}, {1: "silent"}) == (False, "group 1 failed: silent")


def test_a_vote_that_outlived_the_coordinator_is_decided_by_what_members_do_next():
    q = Quorum("old-5-0", 5, 0, "", 0, (0, 1), {0: 1.0, 1: 1.0})
    votes = {(0, 0): (True, "")}
    assert commit_outcome(q, {0: 1, 1: 1}, votes, {}, {}) is None
    assert commit_outcome(q, {0: 1, 1: 1}, votes, {}, {1: 6})[0] is True  # 1 was told "commit"
    assert commit_outcome(q, {0: 1, 1: 1}, votes, {}, {1: 5})[0] is False  # 1 was told "roll back"


@pytest.mark.parametrize("weights,group,expected", [
    ({0: 5.0, 1: 5.0}, 0, 1.0),
    ({0: 5.0, 1: 0.0}, 0, 2.0),
    ({0: 5.0, 1: 0.0}, 1, 0.0),
    ({0: 1.0, 1: 3.0}, 1, 1.5),
    ({0: 0.0, 1: 0.0}, 0, 0.0),
])
def test_weighted_scale_makes_the_plain_ring_mean_a_weighted_mean(weights, group, expected):
    assert weighted_scale(weights, group) == expected
    if sum(weights.values()):
        values = {0: 2.0, 1: 6.0}
        plain = sum(weighted_scale(weights, g) * values[g] for g in weights) / len(weights)
        assert plain == pytest.approx(sum(weights[g] * values[g] for g in weights) / sum(weights.values()))


@pytest.mark.parametrize("weights,group,expected", [
    ({0: 5.0, 1: 5.0}, 0, 0.5),
    ({0: 1.0, 1: 3.0}, 1, 0.75),
    ({0: 5.0, 1: 0.0}, 1, 0.0),  # a healer or a refused contribution
    ({0: 5.0, 1: 5.0}, 2, 0.0),  # not in the quorum
    ({0: 0.0, 1: 0.0}, 0, 0.0),
])
def test_own_share_is_the_part_of_the_weighted_mean_a_group_contributed(weights, group, expected):
    assert own_share(weights, group) == expected
    if group in weights and sum(weights.values()):  # the same as its scale over G
        assert own_share(weights, group) == pytest.approx(weighted_scale(weights, group) / len(weights))


def test_how_a_summary_says_its_group_ended():
    assert summary_kind({"param_hash": "h", "eval_loss": 2.5}) == TRAINED
    assert summary_kind({"param_hash": "h", "stopped_at_step": 40}) == TRAINED  # the job's agreed stop
    assert summary_kind({"param_hash": "h", "stopped_at_step": 40, "stopped_by": "SIGTERM"}) == STOPPED
    assert summary_kind({"joined_late": True, "reason": "late"}) == LATE
    assert summary_kind({"joined_late": "yes", "param_hash": "h"}) == TRAINED  # only True: held to the hash check
    assert summary_kind({}) == TRAINED  # a summary of nothing is checked as a model (its missing hash is a problem)
    summaries = {0: {"param_hash": "h"}, 1: {"stopped_by": "SIGTERM"}, 2: {"joined_late": True}}
    assert trained_groups(summaries) == {0}


def test_the_job_is_finished_once_no_group_is_still_to_come_back():
    trained, stopped, late = {"param_hash": "h"}, {"stopped_by": "SIGTERM"}, {"joined_late": True}
    assert job_finished(2, {0: trained, 1: trained})
    assert job_finished(2, {0: trained, 1: late})
    assert not job_finished(2, {0: trained})  # group 1 has not reported
    assert not job_finished(2, {0: trained, 1: stopped})  # a deleted pod: it restarts and resumes
    assert not job_finished(2, {0: trained, 5: trained})  # only the expected groups count
