"""The launcher that started a group tells the coordinator at once when the group's process tree
ended (``CoordinatorServer.group_exited``): the group is failed then, not after its heartbeats
stop, so the others' quorums and ring retries go on at once. Fake clock: no time passes here."""

import time

import pytest

from diloco.coordinator.messages import HeartbeatRequest, SummaryRequest
from diloco.coordinator.quorum import QuorumError

from .round_helpers import ask_in_thread, formed


def test_the_others_quorum_forms_at_once_when_a_group_s_process_exited():
    state, _ = formed(3, heartbeat_timeout_s=60.0)
    got: dict = {}
    threads = [ask_in_thread(state, g, 0, got) for g in (0, 1)]
    time.sleep(0.5)
    assert not got  # group 2 is live and heartbeating as far as the coordinator knows: it is waited for
    assert state.group_exited(2, "its process was killed") is True
    for t in threads:
        t.join(timeout=5)
    assert sorted(got[0].members) == [0, 1] and got[0].id == got[1].id
    assert state.snapshot()["rounds_state"]["failed_groups"] == {2: "its process was killed"}
    assert state.group_exited(2, "again") is False  # once
    with pytest.raises(QuorumError, match="declared failed") as info:  # a straggling rank of it is refused
        state.heartbeat(HeartbeatRequest(2, 0, 5))
    assert info.value.code == "FAILED_PRECONDITION"


def test_the_members_running_an_exchange_hear_at_once_that_one_of_them_exited():
    state, _ = formed(3, heartbeat_timeout_s=60.0)
    got: dict = {}
    for t in [ask_in_thread(state, g, 0, got) for g in range(3)]:
        t.join(timeout=5)
    q = got[0].id
    assert state.quorum_lost(q, 0) == ""
    state.group_exited(1, "its process exited with code 75")
    assert state.quorum_lost(q, 0) == f"group 1 of quorum {q} failed: its process exited with code 75"


def test_a_finished_or_unknown_group_is_not_failed_by_its_exit():
    state, _ = formed(2, heartbeat_timeout_s=60.0)
    state.summary(SummaryRequest(1, {"final_step": 10}))
    assert state.group_exited(1, "exited") is False  # it finished: its exit is the end of the job for it
    assert state.group_exited(7, "exited") is False  # never joined
    assert state.snapshot()["rounds_state"]["failed_groups"] == {}
