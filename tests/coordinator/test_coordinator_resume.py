"""Where a job started from checkpoints continues: the pure rule (``diloco.coordinator.resume``) and
the coordinator applying it as the job forms (groups behind the newest step heal; a named step that
is not every group's halts the job before it starts). The processes: tests/runtime/test_resume_behind.py."""

import threading
import time

import pytest

from diloco.coordinator.messages import JoinRequest
from diloco.coordinator.metrics import status_document
from diloco.coordinator.quorum import QuorumError
from diloco.coordinator.resume import NONE, describe, resume_start
from diloco.coordinator.state import CoordinatorState
from diloco.runtime.ops.status import format_status


def test_the_job_resumes_from_the_newest_step_and_the_groups_behind_heal():
    start = resume_start({0: 40, 1: 60, 2: NONE, 3: 60})
    assert start.step == 60 and start.behind == (0, 2) and start.refused is None
    assert describe({0: 40, 2: NONE}) == "group 0: step 40, group 2: none"


def test_no_checkpoint_anywhere_is_a_fresh_start_and_step_zero_is_a_step():
    assert resume_start({0: NONE, 1: NONE}).step == NONE and resume_start({0: NONE, 1: NONE}).behind == ()
    start = resume_start({0: 0, 1: NONE})
    assert start.step == 0 and start.behind == (1,)


def test_a_named_step_must_be_every_groups():
    assert resume_start({0: 40, 1: 40}, named={0, 1}).refused is None
    refused = resume_start({0: 40, 1: 20}, named={1}).refused
    assert refused is not None and "group(s) 1 named a checkpoint step" in refused
    assert "(group 0: step 40, group 1: step 20)" in refused
    assert resume_start({0: 40, 1: NONE}, named={0}).refused is not None  # a group with none is behind too


def join_all(state, requests):
    out, errors = {}, {}

    def join(req):
        try:
            out[(req.group, req.rank)] = state.join(req, deadline=1e9)
        except QuorumError as e:
            errors[(req.group, req.rank)] = e

    threads = [threading.Thread(target=join, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    return out, errors


def test_the_coordinator_makes_the_groups_behind_healers_as_the_job_starts():
    state = CoordinatorState(3, heartbeat_timeout_s=15.0)
    try:
        out, errors = join_all(state, [JoinRequest(0, r, 2, f"10.0.0.{r}:7000", resume_step=20) for r in range(2)]
                               + [JoinRequest(1, 0, 1, "10.0.1.0:7000", resume_step=40),
                                  JoinRequest(2, 0, 1, "10.0.2.0:7000")])  # started without --resume
        assert not errors
        assert [out[(0, r)].heal for r in range(2)] == [True, True] and out[(2, 0)].heal
        assert not out[(1, 0)].heal and {m.resume_step for m in out.values()} == {40}
        rounds_state = state.snapshot()["rounds_state"]
        assert rounds_state["live_groups"] == [1] and rounds_state["healing_groups"] == [0, 2]
        assert rounds_state["failures"] == 0  # behind is not failed
        assert [e["group"] for e in rounds_state["events"] if e["kind"] == "resume_behind"] == [0, 2]
        assert rounds_state["resume_step"] == 40 and rounds_state["resumed_behind"] == {0: 20, 2: NONE}
        assert ("resumed from checkpoint step 40; behind it, healing from the others: group 0 (its newest: step 20), "
                "group 2 (its newest: none)") in format_status(status_document(state.snapshot()))
    finally:
        state.close()


def test_a_fresh_job_has_no_healers():
    state = CoordinatorState(2, heartbeat_timeout_s=15.0)
    try:
        out, errors = join_all(state, [JoinRequest(g, 0, 1, f"10.0.{g}.0:7000") for g in range(2)])
        assert not errors and not any(m.heal for m in out.values())
        assert {m.resume_step for m in out.values()} == {NONE}
        assert "resumed from" not in format_status(status_document(state.snapshot()))
    finally:
        state.close()


def test_a_named_step_that_is_not_every_groups_halts_the_job_before_it_starts():
    state = CoordinatorState(2, heartbeat_timeout_s=15.0)
    try:
        out, errors = join_all(state, [JoinRequest(0, 0, 1, "10.0.0.0:7000", resume_step=40, resume_exact=True),
                                       JoinRequest(1, 0, 1, "10.0.1.0:7000", resume_step=20)])
        assert not out and len(errors) == 2
        assert all(e.halted and "named a checkpoint step" in str(e) for e in errors.values())
        assert "group 0: step 40, group 1: step 20" in state.snapshot()["rounds_state"]["halted"]
    finally:
        state.close()


def test_the_ranks_of_a_group_must_resume_from_one_step():
    state = CoordinatorState(1, heartbeat_timeout_s=15.0)
    first: list = []

    def rank0():  # waits for rank 1 until the state closes
        try:
            state.join(JoinRequest(0, 0, 2, "10.0.0.0:7000", resume_step=40), deadline=1e9)
        except QuorumError as e:
            first.append(e)

    waiter = threading.Thread(target=rank0, daemon=True)
    waiter.start()
    try:
        for _ in range(100):  # until rank 0's join is recorded
            if state.snapshot()["groups"]:
                break
            time.sleep(0.05)
        with pytest.raises(QuorumError, match="resumes from step 20, its rank 0 from step 40") as info:
            state.join(JoinRequest(0, 1, 2, "10.0.0.1:7000", resume_step=20), deadline=1e9)
        assert info.value.code == "INVALID_ARGUMENT"
        with pytest.raises(QuorumError, match="its rank 0 from step 40"):  # a named step differs as well
            state.join(JoinRequest(0, 1, 2, "10.0.0.1:7000", resume_step=40, resume_exact=True), deadline=1e9)
        # a join refused for another reason records nothing: rank 1 at rank 0's step joins after it
        with pytest.raises(QuorumError, match="out of range"):
            state.join(JoinRequest(0, 3, 2, "10.0.0.3:7000", resume_step=99), deadline=1e9)
        member = state.join(JoinRequest(0, 1, 2, "10.0.0.1:7000", resume_step=40), deadline=1e9)
        assert member.resume_step == 40 and not member.heal
    finally:
        state.close()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and not first  # rank 0's join returned the membership
