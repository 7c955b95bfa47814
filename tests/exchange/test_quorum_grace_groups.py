"""Survivors do not stall for a lost group (issue 32, point 2), end to end in one process: a real
coordinator, real links, groups as threads (test_fault_tolerance's harness). A killed group is
left out once the grace window ends, far sooner than the heartbeat timeout; a healer whose state
transfer is slow joins an exchange that commits without waiting for that transfer."""

from __future__ import annotations

import time

import pytest
import test_fault_tolerance as ft

from diloco.coordinator import CoordinatorServer

GRACE_S = 1.5
MARGIN_S = 3.0  # scheduling on a loaded 2-core host
SLOW_FETCH_S = 2.5  # < the links' 4 s deadline, which the donor's send waits out


@pytest.fixture
def server():
    made: list[CoordinatorServer] = []

    def make(**kwargs) -> CoordinatorServer:
        s = CoordinatorServer("127.0.0.1", 0, expected_groups=3, join_timeout_s=30.0, **kwargs)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def test_survivors_commit_within_the_grace_window_not_the_heartbeat_timeout(server):
    """A killed group is left out of each exchange once the window ends, and failed once it has been
    silent for three heartbeat intervals (a fifth of the timeout) since, not at the heartbeat timeout: a
    group that is merely late keeps heartbeating and catches up instead (no restart)."""
    heartbeat_s = 30.0  # the coordinator would wait this long for the dead group without the window
    silent_s = heartbeat_s / 5
    coordinator = server(heartbeat_timeout_s=heartbeat_s, quorum_grace_s=GRACE_S)
    started = time.monotonic()
    groups = [ft.Group(coordinator.address, g, die_at=13 if g == 2 else None, step_delay_s=0.05).start()
              for g in range(3)]
    ft.finish(groups[:2])
    groups[2].join()
    assert groups[2].killed.is_set()
    assert time.monotonic() - started < heartbeat_s
    assert groups[0].final_hash == groups[1].final_hash
    assert groups[0].engine.inner_step == ft.STEPS
    state = coordinator.snapshot()["rounds_state"]
    left = [e for e in state["events"] if e["kind"] == "left_out"]
    assert left and all(e["groups"] == [2] for e in left)
    reason = state["failed_groups"][2]
    assert "missed exchange" in reason and "silent" in reason, reason  # failed by the rule, not the timeout
    failed_at = next(e["at_s"] for e in state["events"] if e["kind"] == "failure" and e["group"] == 2)
    assert failed_at - left[0]["at_s"] < silent_s + MARGIN_S
    stalls = [e["seconds"] for e in state["events"] if e["kind"] == "stall"]
    assert stalls and max(stalls) < GRACE_S + MARGIN_S, stalls
    for g in groups[:2]:
        s = g.link.fault_stats
        assert s.failures_seen == 1 and max(s.stall_seconds) < GRACE_S + MARGIN_S, s.stall_seconds


def slow_transfer(seconds: float):
    """An on_connected hook: this group's state fetch first sleeps ``seconds`` (a large model's transfer)."""

    def hook(link) -> None:
        transfer = link.averager._transfer
        fetch = transfer._fetch

        def slow(*args, **kwargs):
            time.sleep(seconds)
            return fetch(*args, **kwargs)

        transfer._fetch = slow

    return hook


def test_a_healer_joins_an_exchange_that_commits_without_waiting_for_its_state_transfer(server):
    coordinator = server(heartbeat_timeout_s=ft.HEARTBEAT_S)
    first = [ft.Group(coordinator.address, g, die_at=13 if g == 2 else None).start() for g in range(3)]
    first[2].join()
    assert first[2].killed.is_set()
    time.sleep(0.5)
    healer = ft.Group(coordinator.address, 2, on_connected=slow_transfer(SLOW_FETCH_S)).start()
    survivors = [first[0], first[1], healer]
    ft.finish(survivors)
    assert len({g.final_hash for g in survivors}) == 1  # the late state plus the committed mean: the same
    assert healer.engine.inner_step == ft.STEPS and healer.link.fault_stats.healed
    assert healer.link.fault_stats.heal_seconds >= SLOW_FETCH_S
    state = coordinator.snapshot()["rounds_state"]
    healed = [e for e in state["events"] if e["kind"] == "healed"]
    assert len(healed) == 1 and state["heals"] == 1
    exchange = healed[0]["exchange"]
    for g in first[:2]:  # the exchange the healer joined took the survivors far less than its transfer
        took = [seconds for e, seconds, _, groups in g.link.fault_stats.exchanges if e == exchange]
        assert took and took[0] < SLOW_FETCH_S - 0.5, (exchange, g.link.fault_stats.exchanges)


def first_transfer_fails(link) -> None:
    """This group's first state fetch fails (a donor lost mid-transfer, a corrupt blob)."""
    from transport import TransportError

    transfer = link.averager._transfer
    fetch, calls = transfer._fetch, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise TransportError("the donor went away mid-transfer (injected)")
        return fetch(*args, **kwargs)

    transfer._fetch = flaky


def test_a_transfer_that_fails_after_its_exchange_committed_heals_again_in_the_next_quorum(server):
    coordinator = server(heartbeat_timeout_s=ft.HEARTBEAT_S)
    first = [ft.Group(coordinator.address, g, die_at=13 if g == 2 else None).start() for g in range(3)]
    first[2].join()
    time.sleep(0.5)
    healer = ft.Group(coordinator.address, 2, on_connected=first_transfer_fails).start()
    survivors = [first[0], first[1], healer]
    ft.finish(survivors)
    assert len({g.final_hash for g in survivors}) == 1 and healer.link.fault_stats.healed
    events = coordinator.snapshot()["rounds_state"]["events"]
    assert any(e["kind"] == "joined" and e["group"] == 2 and e.get("again") for e in events)
    assert [e["kind"] for e in events if e.get("group") == 2].count("healed") == 2  # committed twice as a healer


ROUND_S, ROUNDS, STEP_S = 1.2, 6, 0.02
TIMED_FETCH_S = 0.8  # < ROUND_S: the transfer fits in the others' next round


class TimedGroup(ft.Group):
    """A group whose rounds are by time (``TimeRounds``): each ends ROUND_S after the last commit."""

    def __init__(self, address: str, group: int, *, die_after_round: int | None = None, on_connected=None) -> None:
        super().__init__(address, group, on_connected=on_connected)
        self.die_after_round = die_after_round

    def _train(self) -> None:
        import torch

        import diloco
        from diloco.engine.schedule import TimeRounds

        opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.engine = diloco.DiLoCo(self.model, opt, averager=self.link, mode="blocking",
                                    sync_every=TimeRounds(ROUND_S, ROUNDS))
        t = self.engine.inner_step
        while not self.engine.rounds_done:
            if self.killed.is_set() or (self.die_after_round is not None
                                        and self.engine.rounds[0] >= self.die_after_round):
                return self.kill()
            self.inner_step(opt, *ft.batch(self.group, t), t)
            time.sleep(STEP_S)
            self.engine.step()
            t += 1
        self.engine.close()
        self.final_hash = self.engine.global_hash()


def test_with_rounds_by_time_a_healers_transfer_shortens_its_first_round_and_stalls_no_one(server):
    """The healer's first round runs from the commit it joined, like the others', not from the end
    of its state transfer: it asks for its first exchange as a member on time."""
    coordinator = server(heartbeat_timeout_s=ft.HEARTBEAT_S)
    first = [TimedGroup(coordinator.address, g, die_after_round=1 if g == 2 else None).start() for g in range(3)]
    first[2].join()
    assert first[2].killed.is_set()
    healer = TimedGroup(coordinator.address, 2, on_connected=slow_transfer(TIMED_FETCH_S)).start()
    survivors = [first[0], first[1], healer]
    ft.finish(survivors)
    assert len({g.final_hash for g in survivors}) == 1 and healer.link.fault_stats.healed
    state = coordinator.snapshot()["rounds_state"]
    healed = [e["exchange"] for e in state["events"] if e["kind"] == "healed"]
    assert len(healed) == 1
    for g in first[:2]:
        took = {e: seconds for e, seconds, _, _ in g.link.fault_stats.exchanges}
        assert healed[0] + 1 in took and took[healed[0] + 1] < TIMED_FETCH_S / 2, g.link.fault_stats.exchanges


CATCH_UP_H, CATCH_UP_STEPS, CATCH_UP_STEP_S = 40, 160, 0.03  # rounds of about 1.2 s, longer than the transfer


class CatchingUpGroup(ft.Group):
    """The harness's group with the worker's catch-up, H=CATCH_UP_H: after healing into rounds of
    fixed H it counts steps untrained while ``steps_behind`` says so. Records its contributions'
    weights (inner steps)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weights: dict[str, float] = {}
        self.skipped = 0

    def _train(self) -> None:
        import torch

        import diloco

        start = self.link.averager.start

        def recording(flat, *, tag, weight=1.0, **kw):
            self.weights[tag] = weight
            return start(flat, tag=tag, weight=weight, **kw)

        self.link.averager.start = recording
        opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.engine = diloco.DiLoCo(self.model, opt, averager=self.link, sync_every=CATCH_UP_H)
        t = self.engine.inner_step
        while t < CATCH_UP_STEPS:
            if self.killed.is_set() or t == self.die_at:
                return self.kill()
            if self.engine.catching_up and self.engine.steps_behind() > 0:
                self.engine.skip_step()
                self.skipped += 1
            else:
                self.inner_step(opt, *ft.batch(self.group, t), t)
                time.sleep(CATCH_UP_STEP_S)
                self.engine.step()
            t += 1
        self.engine.close()
        self.final_hash = self.engine.global_hash()


def test_with_fixed_h_a_healer_skips_the_steps_its_transfer_took_and_stalls_no_one(server):
    """Rounds of fixed H (about 1.2 s): the healer's transfer (0.8 s) ends inside the others' next
    round; it counts the steps the transfer took untrained, launches its first exchange as a
    member with the others, weighted by the steps it trained, and nobody waits for it (without
    the catch-up they would wait about the transfer)."""
    coordinator = server(heartbeat_timeout_s=ft.HEARTBEAT_S)
    first = [CatchingUpGroup(coordinator.address, g, die_at=50 if g == 2 else None).start() for g in range(3)]
    first[2].join()
    assert first[2].killed.is_set()
    healer = CatchingUpGroup(coordinator.address, 2, on_connected=slow_transfer(TIMED_FETCH_S)).start()
    survivors = [first[0], first[1], healer]
    ft.finish(survivors)
    assert len({g.final_hash for g in survivors}) == 1 and healer.link.fault_stats.healed
    assert healer.skipped >= TIMED_FETCH_S / CATCH_UP_STEP_S / 2 and not first[0].skipped
    healed = [e["exchange"] for e in coordinator.snapshot()["rounds_state"]["events"] if e["kind"] == "healed"]
    assert len(healed) == 1
    first_own = next(tag for tag in healer.weights if tag.startswith("f0/"))  # its first contribution as a member
    assert healer.weights[first_own] == CATCH_UP_H - healer.skipped and first[0].weights[first_own] == CATCH_UP_H
    for g in first[:2]:
        took = {e: seconds for e, seconds, _, _ in g.link.fault_stats.exchanges}
        assert healed[0] + 1 in took and took[healed[0] + 1] < TIMED_FETCH_S / 2, g.link.fault_stats.exchanges
