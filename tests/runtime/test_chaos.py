"""The fault drill's decisions (pure): spacing, who may be killed, restarts, the end of the drill."""

import pytest

from diloco.runtime.launch.chaos import ChaosMonkey


def drive(monkey: ChaosMonkey, seconds: float, groups: int = 3, progress=lambda t: 0.0):
    running, kills, restarts = set(range(groups)), [], []
    t = 0.0
    while t < seconds:
        plan = monkey.tick(t, live=set(running), running=set(running), progress=progress(t))
        for g in plan.kill:
            assert g in running
            running.discard(g)
            kills.append((t, g))
        for g in plan.restart:
            assert g not in running
            running.add(g)
            restarts.append((t, g))
        assert running, "the drill must always leave one live group"
        t += 0.05
    return kills, restarts


def test_kills_are_spaced_restarted_and_reproducible():
    kills, restarts = drive(ChaosMonkey(5, seed=3, gap_s=(1.0, 2.0), pause_s=(0.2, 0.5)), 30)
    assert len(kills) == 5
    times = [t for t, _ in kills]
    assert all(b - a >= 1.0 - 1e-9 for a, b in zip(times, times[1:]))
    assert len(restarts) == 5
    again, _ = drive(ChaosMonkey(5, seed=3, gap_s=(1.0, 2.0), pause_s=(0.2, 0.5)), 30)
    assert again == kills


def test_never_kills_the_last_live_group_nor_after_the_stop_fraction():
    kills, _ = drive(ChaosMonkey(50, seed=1, gap_s=(0.0, 0.1), pause_s=(5.0, 5.0)), 3, groups=2)
    assert len(kills) == 1  # the other group is down for 5 s: the survivor is never killed
    kills, _ = drive(ChaosMonkey(50, seed=1, gap_s=(0.5, 0.5)), 20, progress=lambda t: t / 10)
    assert kills and max(t for t, _ in kills) < 8.0 + 1e-9  # stop_fraction 0.8 of a job done at t=10


def test_a_stale_live_set_never_lets_the_drill_kill_the_last_healthy_group():
    """The coordinator still counts a killed group live until it notices: the drill must wait
    until it saw the group drop out and heal back before it counts it healthy again."""
    monkey = ChaosMonkey(10, seed=5, gap_s=(0.0, 0.0), pause_s=(0.1, 0.1))
    stale_live = {0, 1, 2}
    killed = []
    for i in range(200):
        plan = monkey.tick(i * 0.05, live=stale_live, running={0, 1, 2}, progress=0.0)
        killed += plan.kill
    # the live set never changed, so no victim ever "came back": two kills, the last healthy group spared
    assert len(killed) == 2 and len(set(killed)) == 2
    spared = ({0, 1, 2} - set(killed)).pop()
    first = killed[0]
    killed += monkey.tick(20.0, live={spared}, running={0, 1, 2}, progress=0.0).kill  # both noticed
    assert len(killed) == 2
    killed += monkey.tick(20.1, live={spared, first}, running={0, 1, 2}, progress=0.0).kill  # one healed back
    assert len(killed) == 3 and killed[2] in {spared, first}


def test_a_drill_of_stalls_and_kills_freezes_groups_for_stall_s_and_wakes_them():
    monkey = ChaosMonkey(8, seed=2, gap_s=(1.0, 1.0), pause_s=(0.2, 0.2), kinds=("kill", "stall"), stall_s=(3.0, 3.0))
    live, running, frozen = {0, 1, 2, 3}, {0, 1, 2, 3}, {}
    stalls, kills, t = [], [], 0.0
    while t < 60:
        plan = monkey.tick(t, live=set(live), running=set(running), progress=0.0)
        for g in plan.stall:
            assert g in running and g not in frozen
            frozen[g] = t
            stalls.append(g)
            live.discard(g)  # the coordinator declares it failed; it heals once woken
        for g in plan.resume:
            assert 3.0 - 1e-9 <= t - frozen.pop(g) <= 3.05 + 1e-9
            live.add(g)
        for g in plan.kill:
            running.discard(g)
            live.discard(g)
            kills.append(g)
        for g in plan.restart:
            running.add(g)
            live.add(g)
        assert not set(plan.restart) & set(plan.resume)
        t += 0.05
    assert len(stalls) + len(kills) == 8 and stalls and kills and not frozen


def test_a_corrupt_fault_leaves_its_group_up_and_healthy():
    """A bit flipped on a group's link takes nothing down: no restart or wake is planned, and the
    same group may be hit again at the next fault."""
    monkey = ChaosMonkey(6, seed=4, gap_s=(1.0, 1.0), kinds=("corrupt",))
    hits, t = [], 0.0
    while t < 10:
        plan = monkey.tick(t, live={0, 1}, running={0, 1}, progress=0.0)
        assert not (plan.kill or plan.stall or plan.restart or plan.resume)
        hits += [(round(t, 2), g) for g in plan.corrupt]
        t += 0.05
    assert len(hits) == 6 and monkey.kills_left == 0 and not monkey.down
    assert [b[0] - a[0] for a, b in zip(hits, hits[1:])] == pytest.approx([1.0] * 5, abs=0.06)
    assert {g for _, g in hits} == {0, 1}  # either group, the drill never waits for one to heal


def test_a_drill_refuses_unknown_kinds():
    with pytest.raises(ValueError, match="kinds"):
        ChaosMonkey(1, kinds=("kill", "flood"))
    with pytest.raises(ValueError, match="stall_s"):
        ChaosMonkey(1, kinds=("stall",), stall_s=(5.0, 1.0))


def test_freeze_tree_stops_a_process_and_its_children_and_lets_them_go_on():
    import subprocess
    import sys
    import time

    from diloco.runtime.ops.processes import _stat_fields, descendants, freeze_tree, kill_tree

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                               "time.sleep(60)"])
    try:
        deadline = time.monotonic() + 20
        while not descendants(parent.pid):
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.05)
        tree = [parent.pid, *descendants(parent.pid)]

        def states() -> list[str]:
            time.sleep(0.2)  # the signals are delivered asynchronously
            return [(_stat_fields(pid) or ["?"])[0] for pid in tree]

        freeze_tree(parent, True)
        assert states() == ["T"] * len(tree)
        freeze_tree(parent, False)
        assert "T" not in states()
    finally:
        kill_tree(parent)
