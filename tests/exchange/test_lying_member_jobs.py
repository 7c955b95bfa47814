"""A member that lies, in live jobs (issue 46): a real coordinator, real links, groups as threads
(test_fault_tolerance's harness), one group's coordinator client or votes tampered with. Each job
ends with the honest groups bit-identical, or stops with a clear error where no honest result
exists (two groups that differ). And a live group the grace window leaves out catches up in place:
no restart, the same final parameters. The same rules at protocol level: tests/coordinator/
test_quorum_attacks.py."""

from __future__ import annotations

import dataclasses
import time

import pytest
import test_fault_tolerance as ft

from diloco.coordinator import CoordinatorServer
from diloco.exchange.heartbeat import GroupEvicted, JobHalted

pytestmark = pytest.mark.slow


@pytest.fixture
def server():
    made: list[CoordinatorServer] = []

    def make(groups: int = 3, **kwargs) -> CoordinatorServer:
        s = CoordinatorServer("127.0.0.1", 0, expected_groups=groups, join_timeout_s=30.0, **kwargs)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def tamper_asks(change):
    """An on_connected hook: every quorum request this group sends is ``change(request)`` instead."""

    def hook(link) -> None:
        send = link.client.quorum
        link.client.quorum = lambda req, **kw: send(change(req), **kw)

    return hook


def forged_hash(req):
    return dataclasses.replace(req, state_hash="forged") if req.state_hash else req


def always_no(link) -> None:
    vote = link.averager.vote
    link.averager.vote = lambda resp, ok, why: vote(resp, False, "this member always says no")


def events(coordinator, kind: str) -> list[dict]:
    return [e for e in coordinator.snapshot()["rounds_state"]["events"] if e["kind"] == kind]


@pytest.mark.parametrize("lie", ["hash", "votes", "far-ahead"])
def test_in_a_three_group_job_the_lying_member_is_put_out_and_the_honest_end_bit_identical(server, lie):
    coordinator = server()
    hooks = {"hash": tamper_asks(forged_hash), "votes": always_no,
             "far-ahead": tamper_asks(lambda r: dataclasses.replace(r, exchange=r.exchange + 1000)
                                      if r.exchange >= 3 else r)}
    groups = [ft.Group(coordinator.address, g, on_connected=hooks[lie] if g == 0 else None).start() for g in range(3)]
    for g in groups:
        g.join()
    assert isinstance(groups[0].error, GroupEvicted), groups[0].error  # exit 75: it restarts and heals
    honest = groups[1:]
    assert all(g.error is None for g in honest), [g.error for g in honest]
    assert honest[0].final_hash == honest[1].final_hash and honest[0].engine.inner_step == ft.STEPS
    state = coordinator.snapshot()["rounds_state"]
    assert list(state["failed_groups"]) == [0] and state["halted"] is None
    said = {"hash": "global state hash forged differs", "votes": "its votes alone rolled back 3 attempts",
            "far-ahead": "more than 64 past the job's next exchange"}[lie]
    assert said in state["failed_groups"][0], state["failed_groups"]


def test_in_a_two_group_job_members_that_differ_stop_both_groups_with_an_error_naming_them(server):
    coordinator = server(groups=2)
    groups = [ft.Group(coordinator.address, g, on_connected=tamper_asks(forged_hash) if g == 1 else None).start()
              for g in range(2)]
    started = time.monotonic()
    for g in groups:
        g.join()
    assert time.monotonic() - started < 60
    for g in groups:  # exit 2 on both sides: a restart would meet the same halted coordinator
        assert isinstance(g.error, JobHalted), g.error
        assert "group 0: " in str(g.error) and "group 1: forged" in str(g.error), g.error
    state = coordinator.snapshot()["rounds_state"]
    assert state["halted"] and state["failed_groups"] == {} and state["evicted"] == 0
    assert len(events(coordinator, "disagreement")) == 2


def test_a_weight_above_what_a_group_can_have_trained_weighs_nothing_and_the_job_ends_identical(server):
    coordinator = server()
    boast = tamper_asks(lambda r: dataclasses.replace(r, weight=1e300) if r.weight_cap > 0 else r)
    groups = [ft.Group(coordinator.address, g, on_connected=boast if g == 2 else None).start() for g in range(3)]
    ft.finish(groups)
    assert len({g.final_hash for g in groups}) == 1  # every member applies the same committed means
    rejected = events(coordinator, "rejected")
    assert rejected and all(e["group"] == 2 and "can have trained" in e["reason"] for e in rejected)
    assert coordinator.snapshot()["rounds_state"]["failed_groups"] == {}


class SlowOnce(ft.Group):
    """A group that stalls ``seconds`` once, before inner step ``at``, while it heartbeats on."""

    def __init__(self, *args, at: int, seconds: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.at, self.seconds = at, seconds

    def inner_step(self, opt, x, y, t) -> None:
        if t == self.at:
            time.sleep(self.seconds)
        super().inner_step(opt, x, y, t)


@pytest.mark.parametrize("mode, fragments", [("blocking", None), ("overlap", ft.LAYERS)])
def test_a_live_group_the_grace_window_leaves_out_catches_up_in_place_and_ends_identical(server, mode, fragments):
    grace_s = 1.0
    coordinator = server(heartbeat_timeout_s=30.0, quorum_grace_s=grace_s)
    groups = [SlowOnce(coordinator.address, g, mode=mode, fragments=fragments, at=22 if g == 2 else -1,
                       seconds=4 * grace_s) for g in range(3)]
    for g in groups:
        g.start()
    ft.finish(groups)  # no group raised: group 2 was never told to restart
    assert len({g.final_hash for g in groups}) == 1 and all(g.engine.inner_step == ft.STEPS for g in groups)
    state = coordinator.snapshot()["rounds_state"]
    assert state["failed_groups"] == {} and state["heals"] == 0
    assert state["caught_up"] >= 1 and all(e["group"] == 2 for e in events(coordinator, "catch_up"))
    assert groups[2].link.fault_stats.caught_up == state["caught_up"]
    assert groups[0].link.fault_stats.catch_ups_served + groups[1].link.fault_stats.catch_ups_served \
        == state["caught_up"]
