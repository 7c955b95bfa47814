"""Survivors do not stall for a lost group (issue 32, point 2): the grace window of a quorum, the
groups it leaves out, healers that heal again, and 'job lost' when every group failed at once.
Pure rules (rounds.py) and the coordinator's state on a fake clock, no processes."""

import threading
import time

import pytest

from diloco.coordinator.messages import (
    CommitRequest,
    HeartbeatRequest,
    JoinRequest,
    QuorumRequest,
)
from diloco.coordinator.metrics import CoordinatorCollector
from diloco.coordinator.quorum import QuorumError
from diloco.coordinator.rounds import (
    HEAL,
    Ask,
    decide,
    grace_over,
    job_lost,
    job_lost_message,
    patient_groups,
    window_closed,
)
from diloco.coordinator.state import CoordinatorState
from diloco.runtime.ops.status import format_status
from round_helpers import FakeClock, ask_in_thread, formed, run_exchange, vote


def ask(exchange=5, weight=10.0):
    return Ask(exchange, "f0/r5", 100, weight, "h1", 1.0, True)


def test_without_a_grace_window_a_quorum_waits_for_every_live_group_however_long():
    asks = {0: ask(), 1: ask()}
    for waited in (None, 0.0, 1e6):
        assert decide(asks, {0, 1, 2}, next_exchange=5, min_groups=1, attempt=0, quorum_id="q",
                      waited_s=waited, grace_s=0.0) is None


def test_once_the_grace_window_ends_the_groups_that_asked_form_the_quorum_without_the_others():
    asks = {0: ask(weight=10.0), 1: ask(weight=30.0)}
    kw = {"next_exchange": 5, "min_groups": 1, "attempt": 0, "quorum_id": "q", "grace_s": 0.5}
    assert decide(asks, {0, 1, 2}, waited_s=None, **kw) is None  # nobody asked yet: no window runs
    assert decide(asks, {0, 1, 2}, waited_s=0.49, **kw) is None
    q = decide(asks, {0, 1, 2}, waited_s=0.5, **kw)
    assert q.groups == (0, 1) and q.left_out == (2,)
    assert dict(q.weights) == {0: 10.0, 1: 30.0} and 2 not in q.weights  # its work is not counted
    every = decide({**asks, 2: ask()}, {0, 1, 2}, waited_s=0.1, **kw)  # all asked: no need to wait
    assert every.groups == (0, 1, 2) and every.left_out == ()


def test_the_window_waits_for_a_late_group_that_heartbeats_not_for_one_that_went_silent():
    """A group frozen or killed while it trained closes the window at once (issue 46, goodput):
    the others waited the whole window for it before; a late group still heard from is waited for."""
    asks = {0: ask(), 1: ask()}
    kw = {"next_exchange": 5, "min_groups": 1, "attempt": 0, "quorum_id": "q", "grace_s": 0.5}
    assert decide(asks, {0, 1, 2}, waited_s=0.01, heartbeating={0, 1, 2}, **kw) is None  # alive: waited for
    q = decide(asks, {0, 1, 2}, waited_s=0.01, heartbeating={0, 1}, **kw)  # silent: not waited for
    assert q.groups == (0, 1) and q.left_out == (2,)
    assert decide({0: ask()}, {0, 1, 2, 3}, waited_s=0.01, heartbeating={0, 1}, **kw) is None  # 1 still heard
    assert decide(asks, {0, 1, 2}, waited_s=None, heartbeating={0, 1}, **kw) is None  # no window yet
    assert decide(asks, {0, 1, 2}, waited_s=0.01, heartbeating={0, 1}, patient={2}, **kw) is None  # healed
    assert decide(asks, {0, 1, 2}, waited_s=1e6, heartbeating={0, 1}, **{**kw, "grace_s": 0.0}) is None  # no window
    assert window_closed([2], 0.01, 0.5, {0, 1}) and not window_closed([2], 0.01, 0.5, {2})
    assert not window_closed([2], 0.01, 0.5, None) and window_closed([2], 0.5, 0.5, {2})


def test_a_group_that_falls_silent_while_the_window_runs_is_not_waited_for_to_its_end():
    """On the coordinator: two of three ask, the third's last heartbeat was 11 s ago (heartbeat
    timeout 60 s: three intervals are 12 s) and the window is 30 s; the quorum forms once the third
    has been silent for 12 s, 1 s after the window opened, not 30 s later."""
    state, clock = formed(3, heartbeat_timeout_s=60.0, quorum_grace_s=30.0)
    run_exchange(state, (0, 1, 2), 0)
    clock.now += 11.0
    for g in (0, 1):
        state.heartbeat(HeartbeatRequest(g, 0, 5))
    got: dict = {}
    threads = [ask_in_thread(state, g, 1, got) for g in (0, 1)]
    time.sleep(0.6)
    assert got == {}  # group 2 is still heard from (11 s): the window waits for it
    clock.now += 1.5
    for t in threads:
        t.join(timeout=5)
    assert sorted(got[0].members) == [0, 1] and list(got[0].left_out) == [2]
    left = [e for e in state.snapshot()["rounds_state"]["events"] if e["kind"] == "left_out"]
    assert left[-1]["groups"] == [2] and left[-1]["waited_s"] == pytest.approx(1.5)  # of a 30 s window


def test_the_grace_window_keeps_min_groups_and_waits_for_a_group_that_just_healed():
    asks = {0: ask()}
    kw = {"next_exchange": 5, "attempt": 0, "quorum_id": "q", "waited_s": 9.0, "grace_s": 0.5}
    assert decide(asks, {0, 1}, min_groups=2, heartbeating={0}, **kw) is None  # below min_groups the survivors wait
    assert decide(asks, {0, 1}, min_groups=1, heartbeating={0}, **kw).left_out == (1,)  # 1 went silent
    assert decide(asks, {0, 1}, min_groups=1, patient={1}, heartbeating={0}, **kw) is None  # healed: its transfer may run
    assert decide(asks, {0, 1, 2}, min_groups=1, patient={1}, **kw) is None
    assert decide({**asks, 1: ask()}, {0, 1, 2}, min_groups=1, patient={1}, **kw).left_out == (2,)


def test_one_group_never_forms_a_quorum_alone_while_another_live_group_heartbeats():
    """A strict majority of the live groups still heard from: one of two never goes on alone
    while the other heartbeats (however long the window), two of three do, and two of four wait
    for a third unless the others went silent."""
    kw = {"next_exchange": 5, "attempt": 0, "quorum_id": "q", "waited_s": 1e6, "grace_s": 0.5, "min_groups": 1}
    assert decide({0: ask()}, {0, 1}, **kw) is None
    assert decide({0: ask()}, {0, 1}, heartbeating={0, 1}, **kw) is None
    assert decide({0: ask(), 1: ask()}, {0, 1, 2}, heartbeating={0, 1, 2}, **kw).left_out == (2,)
    assert decide({0: ask(), 1: ask()}, {0, 1, 2, 3}, heartbeating={0, 1, 2, 3}, **kw) is None
    assert decide({0: ask(), 1: ask()}, {0, 1, 2, 3}, heartbeating={0, 1, 2}, **kw).left_out == (2, 3)
    # a control exchange (the initial agreement, a final reconcile) waits for every live group
    control = Ask(5, "f0/r5", 100, 1.0, "h1", 0.0, False)
    assert decide({0: control, 1: control}, {0, 1, 2}, heartbeating={0, 1}, **kw) is None


def test_a_healed_group_is_waited_for_only_until_it_asks_on_and_only_while_it_is_heard_from():
    healed_at = {1: 7, 2: 9}
    assert patient_groups(healed_at, 9, {1: 0.1, 2: 0.1}, limit_s=0.8) == {1}  # 2 healed in 9 itself
    assert patient_groups(healed_at, 10, {1: 0.1, 2: 0.1}, limit_s=0.8) == {1, 2}
    assert patient_groups(healed_at, 10, {1: 0.9, 2: 0.8}, limit_s=0.8) == {2}  # 1 fell silent: dead
    assert patient_groups(healed_at, 10, {2: 0.1}, limit_s=0.8) == {2}  # never heard from: not waited for


def test_grace_over_is_a_pure_clock_rule_and_refuses_bad_windows():
    assert not grace_over(10.0, 0.0) and not grace_over(None, 1.0)
    assert not grace_over(0.99, 1.0) and grace_over(1.0, 1.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="grace_s"):
            grace_over(1.0, bad)


def test_job_lost_when_no_group_holds_the_state_and_none_finished():
    assert job_lost({0, 1}, failed={0, 1}, healing=set(), finished=set())
    assert job_lost({0, 1}, failed={0}, healing={1}, finished=set())  # a healer holds nothing yet
    assert not job_lost({0, 1}, failed={0}, healing=set(), finished=set())
    assert not job_lost({0, 1}, failed={0}, healing=set(), finished={1})  # the job ended
    assert not job_lost(set(), failed=set(), healing=set(), finished=set())
    assert job_lost_message("/ckpt/step-40") == "job lost: every group failed; resume from checkpoint (/ckpt/step-40)"
    assert "knows of none" in job_lost_message("")


def test_there_is_no_grace_window_before_the_jobs_first_training_commit():
    """Start-up skew is not a fault: a group slow to reach its first exchange is waited for."""
    state, clock = formed(3, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    got: dict = {}
    threads = [ask_in_thread(state, g, 0, got) for g in (0, 1)]
    clock.now += 20.0
    state.heartbeat(HeartbeatRequest(2, 0, 1))
    time.sleep(0.6)
    assert not got  # 20 s past the window: still waiting for group 2
    threads.append(ask_in_thread(state, 2, 0, got))
    for t in threads:
        t.join(timeout=5)
    assert sorted(got[0].members) == [0, 1, 2] and not got[0].left_out


def test_a_live_group_left_out_by_the_grace_window_stays_a_member_and_catches_up():
    state, clock = formed(3, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    run_exchange(state, (0, 1, 2), 0)  # the first training commit: from now on the window applies
    got: dict = {}
    threads = [ask_in_thread(state, g, 1, got) for g in (0, 1)]
    time.sleep(0.3)
    assert not got  # within the window: waiting for group 2
    clock.now += 0.5  # the window ends; group 2 was heard from 0.5 s ago
    for t in threads:
        t.join(timeout=5)
    assert sorted(got[0].members) == [0, 1] and got[0].weights == {0: 1.0, 1: 1.0}
    assert got[0].left_out == {2: ("10.0.2.0:7000",)}
    assert got[0].donor == 1  # the donor (it turns with the exchange) serves group 2
    vote(state, got, (0, 1))
    rs = state.snapshot()["rounds_state"]
    assert rs["committed"] == 2 and rs["live_groups"] == [0, 1, 2] and rs["failed_groups"] == {}
    assert rs["behind"] == {2: [1]}
    late = state.quorum(QuorumRequest(2, 0, "", 1, tag="f0/r1", numel=4, weight=1.0), deadline=1e9)
    assert late.catch_up and late.id == got[0].id and late.donor == 1 and sorted(late.members) == [0, 1]
    assert late.weights == {0: 1.0, 1: 1.0} and not late.evicted
    assert state.snapshot()["rounds_state"]["caught_up"] == 1
    assert sorted(run_exchange(state, (0, 1, 2), 2)[2].members) == [0, 1, 2]  # a member like the others
    again = state.quorum(QuorumRequest(2, 0, "", 1, tag="f0/r1", numel=4, weight=1.0), deadline=1e9)
    assert "already committed without it" in again.evicted  # it caught up once: asking again is out of step


def test_a_left_out_group_that_went_silent_is_failed_when_the_exchange_commits():
    state, clock = formed(3, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    run_exchange(state, (0, 1, 2), 0)
    got: dict = {}
    threads = [ask_in_thread(state, g, 1, got) for g in (0, 1)]
    clock.now += 8.0
    for g in (0, 1):  # their heartbeats run on while they wait
        state.heartbeat(HeartbeatRequest(g, 0, 5))
    clock.now += 6.0  # group 2: silent for 14 s, more than three heartbeat intervals (12 s)
    for t in threads:
        t.join(timeout=5)
    assert got[0].left_out == {2: ("10.0.2.0:7000",)}
    vote(state, got, (0, 1))
    rs = state.snapshot()["rounds_state"]
    assert rs["live_groups"] == [0, 1] and "missed exchange 1" in rs["failed_groups"][2]
    assert "--quorum-grace" in rs["failed_groups"][2] and "silent" in rs["failed_groups"][2]
    with pytest.raises(QuorumError, match="declared failed") as info:  # it heals, losing its round
        state.quorum(QuorumRequest(2, 0, "", 1, tag="f0/r1", numel=4, weight=1.0), deadline=1e9)
    assert info.value.code == "FAILED_PRECONDITION"


def test_without_the_window_the_survivors_wait_for_the_heartbeat_timeout():
    state, clock = formed(3, heartbeat_timeout_s=60.0)
    got: dict = {}
    threads = [ask_in_thread(state, g, 0, got) for g in (0, 1)]
    clock.now += 30.0
    time.sleep(0.6)
    assert not got
    for g in (0, 1):
        state.heartbeat(HeartbeatRequest(g, 0, 5))
    clock.now += 31.0  # group 2: 61 s silent; groups 0 and 1: 31 s
    for t in threads:
        t.join(timeout=5)
    assert sorted(got[0].members) == [0, 1] and got[0].id == got[1].id


def test_a_member_that_asks_to_heal_again_is_not_waited_for_as_a_member():
    state, _ = formed(2, heartbeat_timeout_s=60.0)
    got: dict = {}
    healer = ask_in_thread(state, 1, HEAL, got)
    time.sleep(0.1)
    assert state.snapshot()["rounds_state"]["healing_groups"] == [1]
    member = ask_in_thread(state, 0, 0, got)
    for t in (healer, member):
        t.join(timeout=5)
    assert got[0].id == got[1].id and got[0].healers == (1,) and got[0].weights == {0: 1.0, 1: 0.0}


def every_group_silent(**kwargs):
    state, clock = formed(2, heartbeat_timeout_s=10.0, **kwargs)
    clock.now += 11.0
    return state, clock


def test_every_group_lost_at_once_is_said_at_once_in_status_metrics_and_to_groups_that_come_back():
    state, clock = every_group_silent()
    state.checkpoint_hint = "/ckpt"
    with pytest.raises(QuorumError, match="job lost: every group failed; resume from checkpoint \\(/ckpt\\)"):
        state.heartbeat(HeartbeatRequest(0, 0, 5))  # the sweep finds both groups silent
    rs = state.snapshot()["rounds_state"]
    assert rs["job_lost"] == "job lost: every group failed; resume from checkpoint (/ckpt)"
    assert [e["kind"] for e in rs["events"]].count("job_lost") == 1
    with pytest.raises(QuorumError, match="job lost") as info:  # a restarted group learns it at once
        state.join(JoinRequest(1, 0, 1, "10.0.1.0:7001", incarnation="second"), deadline=clock.now + 1)
    assert info.value.code == "FAILED_PRECONDITION"
    metrics = {m.name: m.samples[0].value for m in CoordinatorCollector(state.snapshot).collect() if m.samples}
    assert metrics["diloco_coordinator_job_lost"] == 1
    assert "JOB LOST: job lost: every group failed" in format_status({"rounds_state": rs})


def test_one_group_left_is_not_a_lost_job_and_a_coordinator_that_restarts_says_why():
    state, clock = formed(2, heartbeat_timeout_s=10.0)
    clock.now += 6.0
    state.heartbeat(HeartbeatRequest(0, 0, 5))
    clock.now += 6.0  # group 1: 12 s silent, group 0: 6 s
    state.heartbeat(HeartbeatRequest(0, 0, 6))
    rs = state.snapshot()["rounds_state"]
    assert list(rs["failed_groups"]) == [1] and rs["job_lost"] is None
    restarting, _ = every_group_silent()
    restarting.restart_when_state_lost = True  # diloco coordinator: exits 75 at once, groups resume
    with pytest.raises(QuorumError):
        restarting.heartbeat(HeartbeatRequest(0, 0, 5))
    assert restarting.state_lost is not None and restarting.state_lost.startswith("job lost")


def test_a_quorum_that_lost_a_member_is_reported_to_the_members_running_its_rings():
    """What a member's heartbeat hears about the quorum whose rings it runs: nothing while the
    quorum can commit; why not once a member failed (silent past the heartbeat timeout) or started
    again (a new incarnation joined), or once the quorum was rolled back."""
    state, clock = formed(3, heartbeat_timeout_s=60.0)
    got: dict = {}
    for t in [ask_in_thread(state, g, 0, got) for g in range(3)]:
        t.join(timeout=5)
    q = got[0].id
    assert [state.quorum_lost(q, g) for g in range(3)] == ["", "", ""]
    assert state.quorum_lost("no-such-quorum", 0) == "" and state.quorum_lost("", 0) == ""
    clock.now += 31.0
    for g in (0, 1):
        state.heartbeat(HeartbeatRequest(g, 0, 5))
    clock.now += 30.0  # group 2: 61 s silent
    state.heartbeat(HeartbeatRequest(0, 0, 6))
    lost = state.quorum_lost(q, 0)
    assert lost.startswith(f"group 2 of quorum {q} failed:") and "heartbeat_timeout_s=60" in lost
    assert state.quorum_lost(q, 7) == ""  # only its members are told

    state, clock = formed(2, heartbeat_timeout_s=60.0)
    got = {}
    for t in [ask_in_thread(state, g, 0, got) for g in range(2)]:
        t.join(timeout=5)
    q = got[0].id
    rejoin = threading.Thread(target=state.join, args=(JoinRequest(1, 0, 1, "10.0.1.0:7000", incarnation="again"),),
                              kwargs={"deadline": clock.now + 1})
    rejoin.start()
    rejoin.join(timeout=5)
    assert state.quorum_lost(q, 0) == f"group 1 of quorum {q} failed: it started again"

    state, _ = formed(2, heartbeat_timeout_s=60.0)
    got = {}
    for t in [ask_in_thread(state, g, 0, got) for g in range(2)]:
        t.join(timeout=5)
    q = got[0].id
    state.commit(CommitRequest(1, 0, "", q, 0, (0, 1), False, "its ring broke"), deadline=1e9)
    assert state.quorum_lost(q, 0) == f"quorum {q} was rolled back: group 1 rank 0: its ring broke"


def test_a_restarted_coordinator_waits_for_every_member_to_rejoin_even_with_a_short_heartbeat_timeout():
    """CI once, --heartbeat-timeout 2: the first group to rejoin a restarted coordinator ran exchange
    11 alone, and the other, whose channel redialed 2.3 s after it, found the exchange committed
    without it and left the job. No quorum forms without a member before MIN_REJOIN_GRACE_S."""
    from diloco.coordinator.joins import MIN_REJOIN_GRACE_S

    def rejoin(state, group: int) -> None:
        state.join(JoinRequest(group, 0, 1, f"10.0.{group}.0:7000", incarnation=f"i{group}", exchange=11),
                   deadline=1e9)

    def wait(state, clock, seconds: float) -> None:  # group 0 heartbeats every 0.5 s meanwhile
        for _ in range(int(seconds / 0.5)):
            clock.now += 0.5
            state.heartbeat(HeartbeatRequest(0, 0, 11, "i0"))
        time.sleep(1.0)  # a waiting call looks at the clock every 0.25 s

    state = CoordinatorState(2, clock=(clock := FakeClock()), heartbeat_timeout_s=2.0)
    rejoin(state, 0)
    got: dict = {}
    first = ask_in_thread(state, 0, 11, got)
    wait(state, clock, 2.5)  # past the heartbeat timeout, within the rejoin grace
    assert got == {}, "a quorum formed without the member that had not rejoined yet"
    rejoin(state, 1)
    second = ask_in_thread(state, 1, 11, got)
    for t in (first, second):
        t.join(timeout=10)
    assert sorted(got[0].members) == sorted(got[1].members) == [0, 1] and got[0].id == got[1].id, got

    state = CoordinatorState(2, clock=(clock := FakeClock()), heartbeat_timeout_s=2.0)  # one that never rejoins
    rejoin(state, 0)
    got = {}
    alone = ask_in_thread(state, 0, 11, got)
    wait(state, clock, MIN_REJOIN_GRACE_S + 0.5)
    alone.join(timeout=10)
    assert sorted(got[0].members) == [0] and not got[0].evicted, got


@pytest.mark.parametrize("grace", [0.5, 0.0])
def test_a_member_silent_while_its_exchange_is_in_flight_is_failed_with_a_window_only(grace):
    state, clock = formed(3, heartbeat_timeout_s=60.0, quorum_grace_s=grace)
    run_exchange(state, (0, 1, 2), 0)
    got: dict = {}
    for t in [ask_in_thread(state, g, 1, got) for g in (0, 1, 2)]:
        t.join(timeout=5)
    assert sorted(got[0].members) == [0, 1, 2]  # exchange 1 is in flight; group 2 freezes in its ring
    clock.now += 8.0
    for g in (0, 1):
        state.heartbeat(HeartbeatRequest(g, 0, 5))
    assert state.snapshot()["rounds_state"]["live_groups"] == [0, 1, 2]  # 8 s: under three intervals (12 s)
    clock.now += 6.0
    for g in (0, 1):  # 14 s silent: the others' calls sweep
        state.heartbeat(HeartbeatRequest(g, 0, 5))
    rs = state.snapshot()["rounds_state"]
    if not grace:  # without a window only the heartbeat timeout (60 s) fails a member
        assert rs["live_groups"] == [0, 1, 2] and not rs["failed_groups"]
        return
    assert rs["live_groups"] == [0, 1]
    why = rs["failed_groups"][2]
    assert "silent for 14.0s" in why and "exchange 1" in why and got[0].id in why and "--quorum-grace" in why
    vote(state, got, (0, 1))  # the attempt the frozen member was in rolls back; the others go on without it
    again = run_exchange(state, (0, 1), 1)
    assert sorted(again[0].members) == [0, 1] and again[0].id != got[0].id
