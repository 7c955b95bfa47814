"""A member that lies, at protocol level (issue 46): the coordinator's state on a fake clock, one-rank
groups asking and voting from threads, each attack of the issue tried in 2- and 3-group jobs. The
same attacks in live jobs: tests/exchange/test_lying_member_jobs.py."""

from __future__ import annotations

import threading
import time

import pytest

from diloco.coordinator.messages import HeartbeatRequest, QuorumRequest
from diloco.coordinator.quorum import QuorumError
from diloco.coordinator.rounds import DISAGREEMENT_LIMIT, VETO_LIMIT
from round_helpers import ask_in_thread, formed, run_exchange, vote


def ask_all(state, exchange: int, fields: dict[int, dict] | None = None, groups=None) -> dict:
    """Every group (``groups``, default all) asks for ``exchange`` (``fields``: per group, what it says)."""
    got: dict = {}
    groups = range(state.expected_groups) if groups is None else groups
    for t in [ask_in_thread(state, g, exchange, got, **(fields or {}).get(g, {})) for g in groups]:
        t.join(timeout=10)
    return got


def live(state) -> list[int]:
    return state.snapshot()["rounds_state"]["live_groups"]


@pytest.mark.parametrize("groups", [2, 3])
def test_a_member_that_asks_far_ahead_or_skips_exchanges_is_out_of_step_and_the_others_go_on(groups):
    state, clock = formed(groups, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    run_exchange(state, range(groups), 0)
    liar = groups - 1
    with pytest.raises(QuorumError, match="more than 64 past the job's next exchange 1") as info:
        state.quorum(QuorumRequest(liar, 0, "", 1000, tag="f0/r1000", numel=4, weight=1.0), deadline=1e9)
    assert info.value.code == "FAILED_PRECONDITION"  # exit 75: it restarts and heals
    assert liar not in live(state)
    got = run_exchange(state, range(liar), 1)  # the others do not wait for it
    assert sorted(got[0].members) == list(range(liar)) and state.snapshot()["rounds_state"]["committed"] == 2

    state, clock = formed(groups, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    run_exchange(state, range(groups), 0)
    with pytest.raises(QuorumError, match="after exchange 0: it skipped exchanges"):
        state.quorum(QuorumRequest(liar, 0, "", 3, tag="f0/r3", numel=4, weight=1.0), deadline=1e9)
    assert liar not in live(state) and sorted(run_exchange(state, range(liar), 1)[0].members) == list(range(liar))


def test_a_member_that_asks_first_waits_alone_and_is_never_a_quorum_of_one():
    """However long past the window, one group's ask is no quorum while the others are heard from;
    once a second asks, the two are a majority of the three and run it (the third catches up)."""
    state, clock = formed(3, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    run_exchange(state, range(3), 0)
    got: dict = {}
    early = ask_in_thread(state, 2, 1, got)
    for _ in range(4):
        clock.now += 5.0
        for g in range(3):  # the early one heartbeats while it waits, as a rank's heartbeat thread does
            state.heartbeat(HeartbeatRequest(g, 0, 5))
        time.sleep(0.3)
    assert got == {} and live(state) == [0, 1, 2]
    second = ask_in_thread(state, 0, 1, got)  # now a majority asked: the window starts
    time.sleep(0.3)
    assert got == {}
    clock.now += 0.6
    for t in (early, second):
        t.join(timeout=5)
    assert sorted(got[2].members) == [0, 2] and list(got[2].left_out) == [1] and live(state) == [0, 1, 2]


@pytest.mark.parametrize("liar", [0, 1])
def test_two_groups_that_differ_evict_nobody_and_halt_the_job_naming_both(liar):
    state, clock = formed(2, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    run_exchange(state, (0, 1), 0)
    lie = {liar: {"state_hash": "h-forged"}}
    honest = {1 - liar: {"state_hash": "h-true"}}
    first = ask_all(state, 1, {**lie, **honest})
    assert all(r.disagreement and not r.evicted and not r.halted for r in first.values()), first
    assert "global state hash" in first[0].disagreement and "group 0" in first[0].disagreement
    assert live(state) == [0, 1]
    for _ in range(DISAGREEMENT_LIMIT - 1):
        again = ask_all(state, 1, {g: {**f, "retry": True} for g, f in {**lie, **honest}.items()})
    assert all(r.halted for r in again.values()), again
    reason = again[0].halted
    assert "group 0: " in reason and "group 1: " in reason and "h-forged" in reason and "h-true" in reason
    rs = state.snapshot()["rounds_state"]
    assert rs["halted"] == reason and rs["failed_groups"] == {} and rs["evicted"] == 0
    with pytest.raises(QuorumError) as info:  # every later call of either group: halted, no restart mends it
        state.heartbeat(HeartbeatRequest(1 - liar, 0, 9))
    assert info.value.code == "FAILED_PRECONDITION" and info.value.halted and "halted" in str(info.value)


@pytest.mark.parametrize("field, lie", [("state_hash", "h-forged"), ("setting", "slo-forged"), ("numel", 5),
                                        ("weight_cap", 1e300)])
def test_in_three_groups_the_one_that_differs_is_evicted_whatever_its_id(field, lie):
    for liar in (0, 2):
        state, clock = formed(3, heartbeat_timeout_s=60.0)
        run_exchange(state, range(3), 0)
        base = {"state_hash": "h-true", "weight_cap": 40.0}
        got = ask_all(state, 1, {g: {**base, field: lie} if g == liar else base for g in range(3)})
        assert got[liar].evicted and liar not in got[liar].members
        honest = [g for g in range(3) if g != liar]
        assert all(sorted(got[g].members) == honest and not got[g].evicted for g in honest)
        assert sorted(live(state)) == honest


def test_a_second_caller_for_the_same_rank_and_exchange_takes_nothing_from_the_first():
    state, clock = formed(2, heartbeat_timeout_s=60.0)
    run_exchange(state, (0, 1), 0)
    got, copy = {}, {}
    real = ask_in_thread(state, 0, 1, got)
    time.sleep(0.3)
    same = ask_in_thread(state, 0, 1, copy)  # the same request: it waits with the first
    time.sleep(0.3)
    with pytest.raises(QuorumError, match="a second process is using this group's credential") as info:
        state.quorum(QuorumRequest(0, 0, "", 1, tag="f0/r1", numel=4, weight=9.0), deadline=1e9)
    assert info.value.code == "INVALID_ARGUMENT"
    other = ask_in_thread(state, 1, 1, got)
    for t in (real, same, other):
        t.join(timeout=5)
    assert got[0].id == copy[0].id == got[1].id and got[0].weights == {0: 1.0, 1: 1.0}


def test_a_weight_above_what_the_group_can_have_trained_is_refused_and_no_weight_overflows():
    state, clock = formed(3, heartbeat_timeout_s=60.0)
    run_exchange(state, range(3), 0)
    cap = {"weight_cap": 40.0}
    got = ask_all(state, 1, {0: {**cap, "weight": 1e300}, 1: {**cap, "weight": 30.0}, 2: {**cap, "weight": 40.0}})
    assert got[1].weights == {0: 0.0, 1: 30.0, 2: 40.0}
    assert "more than group 0 can have trained" in got[1].rejected[0]
    state, clock = formed(2, heartbeat_timeout_s=60.0)
    run_exchange(state, (0, 1), 0)
    got = ask_all(state, 1, {0: {"weight": 1.7e308}, 1: {"weight": 1.0}})  # no cap said: finite shares still
    from diloco.coordinator.rounds import weighted_scale
    assert 1.99 < weighted_scale(got[0].weights, 0) <= 2.0 and weighted_scale(got[0].weights, 1) < 1e-300


def test_in_two_groups_a_member_that_always_votes_no_halts_the_job_naming_both_sides():
    """One no against one yes, three attempts in a row: nothing tells which group is wrong (a liar
    that vetoes, or one whose neighbour broke the rings while voting yes), so nobody is evicted and
    the job halts, naming both sides."""
    state, clock = formed(2, heartbeat_timeout_s=60.0)
    run_exchange(state, (0, 1), 0)
    for attempt in range(VETO_LIMIT):
        got = ask_all(state, 1, {g: {"retry": attempt > 0} for g in range(2)})
        assert all(not r.evicted for r in got.values()), (attempt, got)
        vote(state, {0: got[0]}, [0], ok=False)
        vote(state, got, [1])
    got = ask_all(state, 1, {g: {"retry": True} for g in range(2)})
    assert all(getattr(r, "halted", "") for r in got.values()), got
    halted = state.snapshot()["rounds_state"]["halted"]
    assert "groups [1] voted to commit, groups [0] did not" in halted and state.snapshot()["rounds_state"]["evicted"] == 0


@pytest.mark.parametrize("groups", [3, 4])
def test_a_member_that_always_votes_no_is_evicted_after_the_veto_limit(groups):
    state, clock = formed(groups, heartbeat_timeout_s=60.0)
    run_exchange(state, range(groups), 0)
    liar = 0
    for attempt in range(VETO_LIMIT):
        got = ask_all(state, 1, {g: {"retry": attempt > 0} for g in range(groups)})
        assert all(not r.evicted for r in got.values()), (attempt, got)
        vote(state, {liar: got[liar]}, [liar], ok=False)
        vote(state, got, [g for g in range(groups) if g != liar])
    got = ask_all(state, 1, {g: {"retry": True} for g in range(groups)})  # the next attempt forms: it is out
    assert "its votes alone rolled back 3 attempts in a row" in got[liar].evicted
    honest = [g for g in range(groups) if g != liar]
    assert all(sorted(got[g].members) == honest for g in honest)
    vote(state, got, honest)
    rs = state.snapshot()["rounds_state"]
    assert rs["committed"] == 2 and rs["rolled_back"] == VETO_LIMIT and sorted(live(state)) == honest


def test_a_failure_every_member_saw_blames_nobody():
    state, clock = formed(3, heartbeat_timeout_s=60.0)
    run_exchange(state, range(3), 0)
    for attempt in range(VETO_LIMIT + 1):
        got = ask_all(state, 1, {g: {"retry": attempt > 0} for g in range(3)})
        assert all(not r.evicted and sorted(r.members) == [0, 1, 2] for r in got.values())
        vote(state, got, range(3), ok=False)
    assert state.snapshot()["rounds_state"]["evicted"] == 0 and live(state) == [0, 1, 2]


def test_a_member_that_never_votes_is_evicted_after_the_veto_limit():
    state, clock = formed(3, heartbeat_timeout_s=60.0, join_timeout_s=5.0)
    run_exchange(state, range(3), 0)
    for attempt in range(VETO_LIMIT):
        got = ask_all(state, 1, {g: {"retry": attempt > 0} for g in range(3)})
        voters = [threading.Thread(target=vote, args=(state, got, (g,))) for g in (1, 2)]
        for t in voters:
            t.start()
        time.sleep(0.3)
        clock.now += 6.0  # past the vote timeout (the join timeout): group 0 never voted
        for g in (0, 1, 2):
            state.heartbeat(HeartbeatRequest(g, 0, 5))
        for t in voters:
            t.join(timeout=5)
    got = ask_all(state, 1, {g: {"retry": True} for g in range(3)})
    assert "no vote in time" in got[0].evicted and sorted(got[1].members) == [1, 2]


def test_a_member_heard_from_that_never_asks_is_failed_once_a_majority_waited_the_join_timeout():
    """Three groups, no window: two ask, the third heartbeats but never asks. Once the two (a
    majority) waited the join timeout it is failed as stuck and they go on. In two groups one ask
    is no majority: the other is waited for while it heartbeats (docs/fault_tolerance.md §2.1)."""
    state, clock = formed(3, heartbeat_timeout_s=60.0, join_timeout_s=20.0)
    run_exchange(state, range(3), 0)
    got: dict = {}
    waiting = [ask_in_thread(state, g, 1, got) for g in (0, 1)]
    for _ in range(5):
        clock.now += 4.5
        state.heartbeat(HeartbeatRequest(2, 0, 5))  # alive, but it never asks
        time.sleep(0.3)
    for t in waiting:
        t.join(timeout=5)
    assert sorted(got[0].members) == [0, 1]
    assert "stuck" in state.snapshot()["rounds_state"]["failed_groups"][2]

    state, clock = formed(2, heartbeat_timeout_s=60.0, join_timeout_s=20.0)
    run_exchange(state, (0, 1), 0)
    got = {}
    alone = ask_in_thread(state, 0, 1, got)
    for _ in range(5):
        clock.now += 4.5
        state.heartbeat(HeartbeatRequest(1, 0, 5))
        time.sleep(0.3)
    assert got == {} and live(state) == [0, 1]
    ask_in_thread(state, 1, 1, got).join(timeout=5)
    alone.join(timeout=5)
    assert sorted(got[0].members) == [0, 1]
