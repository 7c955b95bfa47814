"""Coordinator state without gRPC: liveness on a fake clock, replacement, rounds, summaries."""

import threading
import time

import pytest

from diloco.coordinator.messages import (CommitRequest, HeartbeatRequest, JoinRequest, ProgressRequest, QuorumRequest,
                                         RoundRequest, SummaryRequest)
from diloco.coordinator.report import job_summary
from diloco.coordinator.rounds import HEAL
from diloco.coordinator.quorum import QuorumError
from diloco.coordinator.state import CoordinatorState


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def formed(groups=1, size=1, **kwargs):
    clock = FakeClock()
    state = CoordinatorState(groups, clock=clock, **kwargs)
    threads = [threading.Thread(target=state.join, args=(
        JoinRequest(g, r, size, f"10.0.{g}.{r}:7000"),), kwargs={"deadline": 1e9})
        for g in range(groups) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    assert state.snapshot()["complete"]
    return state, clock


def test_silent_member_fails_its_group_which_rejoins_as_a_healer():
    state, clock = formed(groups=2, size=2, heartbeat_timeout_s=10.0)  # group 1 holds the job's state
    clock.now += 6
    assert state.heartbeat(HeartbeatRequest(0, 0, 5)) == 1
    for r in range(2):
        state.heartbeat(HeartbeatRequest(1, r, 5))
    clock.now += 6  # rank 1: 12 s silent; rank 0: 6 s
    snap = state.snapshot()
    assert snap["failed"] == [{"group": 0, "rank": 1, "silent_s": 12.0}]
    assert snap["rounds_state"]["failed_groups"] == {0: "rank 1 sent nothing for 12.0s (heartbeat_timeout_s=10)"}
    with pytest.raises(QuorumError, match="marked failed after 12.0s") as info:
        state.heartbeat(HeartbeatRequest(0, 1, 5))
    assert info.value.code == "FAILED_PRECONDITION"
    with pytest.raises(QuorumError, match="group 0 was declared failed") as info:
        state.heartbeat(HeartbeatRequest(0, 0, 5))  # the whole group is out
    assert info.value.code == "FAILED_PRECONDITION"
    state.progress(ProgressRequest(0, 1, {"step": 5}))  # recorded, but does not revive
    assert state.snapshot()["progress"][0] == {"step": 5}
    rejoin = [threading.Thread(target=state.join, args=(JoinRequest(0, r, 2, f"10.0.0.{r}:7001"),),
                               kwargs={"deadline": clock.now + 1}) for r in range(2)]
    for t in rejoin:
        t.start()
    for t in rejoin:
        t.join(timeout=5)
    snap = state.snapshot()
    assert snap["failed"] == [] and snap["rounds_state"]["healing_groups"] == [0]
    assert state.heartbeat(HeartbeatRequest(0, 1, 6)) == snap["epoch"]


def test_no_failures_before_the_quorum_forms():
    clock = FakeClock()
    state = CoordinatorState(2, heartbeat_timeout_s=1.0, clock=clock)
    with pytest.raises(QuorumError):
        state.join(JoinRequest(0, 0, 1, "h:1"), deadline=clock.now)
    clock.now += 100
    assert state.snapshot()["failed"] == []


def test_heartbeat_from_unknown_member():
    state, _ = formed()
    with pytest.raises(QuorumError, match="group 0 rank 3 has not joined") as info:
        state.heartbeat(HeartbeatRequest(0, 3, 1))
    assert info.value.code == "NOT_FOUND"


def test_timed_out_join_names_missing_and_its_slot_can_be_replaced():
    clock = FakeClock()
    state = CoordinatorState(2, clock=clock)
    with pytest.raises(QuorumError, match="waiting for: group 0: ranks \\[1\\] of 2; group 1: "
                                          "no rank joined") as info:
        state.join(JoinRequest(0, 0, 2, "h:1"), deadline=clock.now)
    assert info.value.code == "DEADLINE_EXCEEDED"
    # the rank restarted on a new port before the quorum formed: it takes its slot back
    with pytest.raises(QuorumError, match="DEADLINE|timed out"):
        state.join(JoinRequest(0, 0, 2, "h:2"), deadline=clock.now)
    assert state.snapshot()["groups"][0]["ranks"] == {0: "h:2"}


def test_round_hashes_and_divergence():
    state, _ = formed(groups=3)
    state.round(RoundRequest(0, 1, "aa"))
    state.round(RoundRequest(1, 1, "aa"))
    assert state.snapshot()["divergence"] == []
    state.round(RoundRequest(2, 1, "bb"))
    state.round(RoundRequest(0, 2, "cc"))
    snap = state.snapshot()
    assert snap["divergence"] == [{"round": 1, "hashes": {0: "aa", 1: "aa", 2: "bb"}}]
    assert snap["rounds"] == {0: 2, 1: 1, 2: 1}


def test_reports_need_a_joined_group():
    state, _ = formed(groups=1)
    with pytest.raises(QuorumError, match="group 5 has no joined rank"):
        state.summary(SummaryRequest(5, {}))


def test_round_hashes_come_only_from_members():
    state, clock = formed(groups=2, heartbeat_timeout_s=10.0)
    with pytest.raises(QuorumError, match="group 5 is not a member: it has no joined rank") as info:
        state.round(RoundRequest(5, 1, "aa"))
    assert info.value.code == "NOT_FOUND"
    clock.now += 6
    state.heartbeat(HeartbeatRequest(0, 0, 5))
    clock.now += 6  # group 1 is declared failed: out of the membership until it heals
    state.snapshot()
    with pytest.raises(QuorumError, match="group 1 is not a member: it was declared failed") as info:
        state.round(RoundRequest(1, 1, "aa"))
    assert info.value.code == "FAILED_PRECONDITION"
    state.round(RoundRequest(0, 1, "aa"))
    assert state.snapshot()["rounds"] == {0: 1}


def test_a_group_restarted_after_the_others_finished_learns_so_at_once():
    state, clock = formed(groups=3)
    state.summary(SummaryRequest(1, {"eval_loss": 1.0}))  # group 1 finished; 0 and 2 still train
    restarted = state.join(JoinRequest(2, 0, 1, "10.0.2.0:7001", incarnation="second"), deadline=clock.now + 1)
    assert restarted.heal and sorted(restarted.members) == [0, 2]  # not the finished group's closed data plane
    state.summary(SummaryRequest(0, {"eval_loss": 1.0}))  # now every other group has finished
    late = state.join(JoinRequest(2, 0, 1, "10.0.2.0:7002", incarnation="third"), deadline=clock.now + 1)
    assert late.heal and sorted(late.members) == [2]
    assert state.snapshot()["rounds_state"]["joined_late"] == []
    answer = state.quorum(QuorumRequest(2, 0, "third", HEAL, healable=True), deadline=clock.now)
    assert answer.finished  # at once: no deadline waited out
    rounds_state = state.snapshot()["rounds_state"]
    assert rounds_state["joined_late"] == [2]  # the job's summary leaves its model-less summary out
    assert rounds_state["healing_groups"] == [] and rounds_state["live_groups"] == []  # it heals from nobody
    assert [e["group"] for e in rounds_state["events"] if e["kind"] == "joined_late"] == [2]


def model_summary(g: int, param_hash: str = "aa") -> dict:
    return {"group": g, "rank": 0, "eval_loss": 2.5, "param_hash": param_hash, "inner_steps": 300}


def late_summary(g: int) -> dict:
    return {"group": g, "rank": 0, "joined_late": True, "reason": f"group {g}: the job's groups finished"}


def stopped_summary(g: int) -> dict:
    return {**model_summary(g), "stopped_at_step": 120, "stopped_by": "SIGTERM", "job_checkpoint": "/ckpt/120"}


def restart_and_ask_to_heal(state, clock, g: int, incarnation: str):
    assert state.join(JoinRequest(g, 0, 1, f"10.0.{g}.0:7100", incarnation=incarnation),
                      deadline=clock.now + 1).heal
    return state.quorum(QuorumRequest(g, 0, incarnation, HEAL, healable=True), deadline=clock.now + 1)


def test_a_group_stopped_by_its_own_sigterm_has_not_finished_and_counts_again_once_back():
    """A deleted pod checkpoints, reports (``stopped_by``) and exits 75: the job is not over, and
    its restart, once it joins again, is a live member, not a finished group."""
    state, clock = formed(groups=2)
    state.summary(SummaryRequest(0, model_summary(0)))
    state.summary(SummaryRequest(1, stopped_summary(1)))
    assert state.wait_finished(0) is None  # group 1 comes back
    assert state.snapshot()["rounds_state"]["live_groups"] == []
    state.join(JoinRequest(1, 0, 1, "10.0.1.0:7100", incarnation="second"), deadline=clock.now + 1)
    snap = state.snapshot()
    assert 1 not in snap["summaries"] and snap["rounds_state"]["healing_groups"] == [1]
    state.summary(SummaryRequest(1, model_summary(1)))  # it trained to the end
    assert state.wait_finished(0) == {0: model_summary(0), 1: model_summary(1)}


def test_a_stopped_group_and_a_killed_one_are_not_told_the_job_finished():
    """Group 1 stopped by SIGTERM, group 0 SIGKILLed at the same time: no group holds the final
    model, so a healer is not told "finished" (it would exit 0 with nothing); the state is lost and
    the job resumes from its checkpoints."""
    state, clock = formed(groups=2)
    state.restart_when_state_lost = True  # as diloco coordinator sets it
    state.summary(SummaryRequest(1, stopped_summary(1)))
    answer = restart_and_ask_to_heal(state, clock, 0, "again")
    assert answer.evicted and "resume from the job checkpoints" in answer.evicted
    assert state.state_lost and state.snapshot()["rounds_state"]["joined_late"] == []


def test_a_summary_from_a_replaced_incarnation_is_ignored():
    """Group 1's restart joined; a summary its old process still sends (stopped, named by its
    incarnation) does not make the running group 'finished' again."""
    state, clock = formed(groups=2)
    state.join(JoinRequest(1, 0, 1, "10.0.1.0:7100", incarnation="second"), deadline=clock.now + 1)
    state.summary(SummaryRequest(1, {**stopped_summary(1), "incarnation": "first"}))
    snap = state.snapshot()
    assert 1 not in snap["summaries"] and snap["rounds_state"]["healing_groups"] == [1]
    assert [e["incarnation"] for e in snap["rounds_state"]["events"] if e["kind"] == "stale_summary_ignored"] == ["first"]
    state.summary(SummaryRequest(1, {**model_summary(1), "incarnation": "second"}))  # its own: kept
    assert state.snapshot()["summaries"][1]["incarnation"] == "second"


def test_a_restart_after_its_own_end_keeps_the_model_it_trained():
    """Group 0 reported the model it trained to the end, then its pod exited (a failed save) and the
    new pod was told the job finished: its late summary does not replace the model's, which stays
    in the identical check (here: a diverged one is still caught)."""
    state, clock = formed(groups=3)
    state.join(JoinRequest(2, 0, 1, "10.0.2.0:7001", incarnation="second"), deadline=clock.now + 1)  # killed
    state.summary(SummaryRequest(0, model_summary(0, "bad")))
    state.summary(SummaryRequest(1, model_summary(1, "aa")))
    assert restart_and_ask_to_heal(state, clock, 0, "again").finished
    state.summary(SummaryRequest(0, late_summary(0)))
    assert restart_and_ask_to_heal(state, clock, 2, "third").finished
    state.summary(SummaryRequest(2, late_summary(2)))
    summaries = state.wait_finished(0)
    assert summaries[0] == model_summary(0, "bad")
    rounds_state = state.snapshot()["rounds_state"]
    assert rounds_state["joined_late"] == [2]
    assert [e["group"] for e in rounds_state["events"] if e["kind"] == "late_summary_ignored"] == [0]
    job = job_summary(summaries, rounds_state["joined_late"])
    assert job["params_identical"] is False and job["model_group_ids"] == [0, 1] and not job["ok"]


def test_a_fresh_group_that_reached_a_restarted_coordinator_first_heals_once_the_others_rejoin():
    """The coordinator and group 1's pod restarted together (a drain): group 1 starts afresh and
    joins the new coordinator before group 0, which kept training, rejoins at its exchange. Group
    1's join returns once the job runs here, as a healer (it held nothing of the job), instead of
    waiting out --join-timeout for a membership that never forms, and is not a live member yet."""
    clock = FakeClock()
    state = CoordinatorState(2, clock=clock, heartbeat_timeout_s=15.0)
    fresh: list = []
    waiter = threading.Thread(target=lambda: fresh.append(state.join(
        JoinRequest(1, 0, 1, "10.0.1.0:7001", incarnation="restarted"), deadline=clock.now + 600)), daemon=True)
    waiter.start()
    try:
        time.sleep(0.3)
        assert not fresh  # before the job runs here it waits, as every first join does
        member = state.join(JoinRequest(0, 0, 1, "10.0.0.0:7000", incarnation="kept", exchange=5),
                            deadline=clock.now + 1)
        assert not member.heal
        waiter.join(timeout=5)
    finally:
        state.close()  # releases a join still waiting
    assert not waiter.is_alive() and fresh[0].heal and sorted(fresh[0].members) == [0, 1]
    rounds_state = state.snapshot()["rounds_state"]  # a closed state still reads
    assert rounds_state["live_groups"] == [0] and rounds_state["healing_groups"] == [1]


def test_wait_for_summaries_times_out_naming_silent_groups():
    state, _ = formed(groups=2)
    state.summary(SummaryRequest(1, {"loss": 1.0}))
    assert state.wait_for_summaries(1, 0.1) == {1: {"loss": 1.0}}
    with pytest.raises(TimeoutError, match="no summary yet from groups \\[0\\]"):
        state.wait_for_summaries(2, 0.1)
    with pytest.raises(ValueError):
        state.wait_for_summaries(3, 0.1)


def test_votes_on_made_up_quorums_of_a_previous_coordinator_are_bounded_per_group():
    """Only a coordinator that replaced another (its members rejoined it) takes votes on quorums it
    never formed (a predecessor's, "orphans"), decides them once every member could rejoin and only
    if they name a majority of the groups that did, and remembers at most MAX_ORPHANS_PER_GROUP of
    one group's, so a group cannot push the other groups' quorums out of memory."""
    from diloco.coordinator.joins import MIN_REJOIN_GRACE_S
    from diloco.coordinator.messages import CommitRequest
    from diloco.coordinator.round_state import MAX_ORPHANS_PER_GROUP

    fresh, _ = formed(groups=2)
    with pytest.raises(QuorumError) as e:  # a coordinator that did not restart has no predecessor
        fresh.commit(CommitRequest(1, 0, "", "old-7-0", 7, (0, 1), True), deadline=1e9)
    assert e.value.code == "NOT_FOUND"

    clock = FakeClock()
    state = CoordinatorState(2, clock=clock)
    for g in (0, 1):  # the groups rejoin a coordinator that replaced theirs, at exchange 8
        state.join(JoinRequest(g, 0, 1, f"h:{g + 1}", incarnation=f"i{g}", exchange=8), deadline=1e9)
    waited = 0.0
    while waited <= max(state.heartbeat_timeout_s, MIN_REJOIN_GRACE_S):  # every member could rejoin
        clock.now += 5.0
        waited += 5.0
        for g in (0, 1):
            state.heartbeat(HeartbeatRequest(g, 0, 8, f"i{g}"))

    def vote(group, quorum_id, groups):
        return state.commit(CommitRequest(group, 0, f"i{group}", quorum_id, 7, groups, True), deadline=1e9)

    votes = [threading.Thread(target=vote, args=(g, "old-7-0", (0, 1))) for g in (0, 1)]
    for t in votes:
        t.start()
    for t in votes:
        t.join(timeout=5)
    assert vote(1, "old-7-0", (0, 1)).committed  # an honest vote on its predecessor's quorum of both groups
    for i in range(MAX_ORPHANS_PER_GROUP - 1):  # a quorum of one group of two: not a majority, rolled back
        assert not vote(0, f"forged-{i}", (0,)).committed
    with pytest.raises(QuorumError) as e:
        vote(0, "forged-one-too-many", (0,))
    assert e.value.code == "FAILED_PRECONDITION" and "group 0" in str(e.value)
    with pytest.raises(QuorumError) as e:
        vote(0, "not-mine", (1,))
    assert e.value.code == "INVALID_ARGUMENT"
    assert vote(1, "old-7-0", (0, 1)).committed  # still remembered, still decided the same way
    assert rounds_state_frontier(state) is None  # a predecessor's quorums set no position here


def rounds_state_frontier(state):
    return state.snapshot()["rounds_state"]["frontier"]


def test_a_healer_learns_the_auto_setting_the_members_run():
    """--codec/--h auto: a group joining a running job learns the setting of its latest quorum
    (to build its engine), and the quorum it heals in tells it the setting that exchange runs
    (to run its codec), which may have changed since it joined."""
    state, clock = formed(groups=2, heartbeat_timeout_s=10.0)

    def at_once(call, requests):
        answers = {}
        threads = [threading.Thread(target=lambda r=r: answers.update({r.group: call(r, deadline=clock.now + 5)}))
                   for r in requests]
        for t in threads:  # in order: a healer asks before the exchange it joins forms
            t.start()
            time.sleep(0.2)
        for t in threads:
            t.join(timeout=5)
        assert len(answers) == len(requests)
        return answers

    first = at_once(state.quorum, [QuorumRequest(g, 0, "", 0, tag="f0/r0", numel=4, weight=1.0,
                                                 setting="slo-h30-d3") for g in range(2)])
    assert {g: a.setting for g, a in first.items()} == {0: "slo-h30-d3", 1: "slo-h30-d3"}
    at_once(state.commit, [CommitRequest(g, 0, "", first[g].id, 0, (0, 1), True, "") for g in range(2)])
    healer = state.join(JoinRequest(1, 0, 1, "10.0.1.0:7001", incarnation="second"), deadline=clock.now + 1)
    assert healer.heal and healer.setting == "slo-h30-d3"
    later = at_once(state.quorum, [QuorumRequest(1, 0, "second", HEAL),
                                   QuorumRequest(0, 0, "", 1, tag="f0/r1", numel=4, weight=1.0, setting="slo-h50-d3")])
    assert later[1].healers == (1,) and later[1].setting == later[0].setting == "slo-h50-d3"
    assert state.join(JoinRequest(1, 0, 1, "10.0.1.0:7002", incarnation="third"),
                      deadline=clock.now + 1).setting == "slo-h50-d3"
