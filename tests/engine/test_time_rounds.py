"""Rounds by time (issue 32, point 1): the pure rule, and two in-process groups at different
speeds on virtual clocks (a step costs the fast group 1 s, the slow group 2 s; an exchange ends
when its last contribution arrives), so the test is exact and independent of the machine's load."""

import threading

import pytest
import torch
import torch.nn as nn

from diloco.engine.averaging import InProcessGroups
from diloco.engine.diloco import DiLoCo
from diloco.engine.schedule import TimeRounds, round_over, time_progress


def test_round_over_ends_within_half_a_step_of_the_deadline():
    assert not round_over(8.9, 10.0, 2.0)  # one more step ends at 10.9: 0.9 past, stopping is 1.1 short
    assert round_over(9.0, 10.0, 2.0)  # a tie ends the round
    assert round_over(10.5, 10.0, 2.0)
    assert not round_over(9.4, 10.0, 1.0) and round_over(9.5, 10.0, 1.0)
    assert round_over(10.0, 10.0, 0.0) and not round_over(9.99, 10.0, 0.0)
    with pytest.raises(ValueError, match="step_seconds"):
        round_over(0.0, 1.0, float("nan"))


def test_time_progress_counts_rounds_and_the_time_into_this_one():
    assert time_progress(0, 0.0, seconds=10, rounds=4) == 0.0
    assert time_progress(1, 5.0, seconds=10, rounds=4) == pytest.approx(1.5 / 4)
    assert time_progress(1, 50.0, seconds=10, rounds=4) == pytest.approx(2 / 4)  # capped at the round
    assert time_progress(4, 0.0, seconds=10, rounds=4) == 1.0


@pytest.mark.parametrize("seconds, rounds", [(0.0, 3), (-1.0, 3), (float("inf"), 3), (5.0, 0)])
def test_time_rounds_refuses_bad_budgets(seconds, rounds):
    with pytest.raises(ValueError):
        TimeRounds(seconds, rounds)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _ClockedMember:
    """An in-process member whose exchange ends, on this group's virtual clock, when the last
    group posted its contribution (as a real blocking exchange does)."""

    def __init__(self, member, clock: _Clock, posted: dict) -> None:
        self.member, self.clock, self.posted = member, clock, posted
        self.weighted, self.num_groups, self.group_index = True, member.num_groups, member.group_index

    def start(self, flat, *, tag, exact=False, weight=1.0):
        self.posted.setdefault(tag, {})[self.group_index] = self.clock.t
        pending, member = self.member.start(flat, tag=tag, exact=exact, weight=weight), self

        class _Pending:
            def wait(self):
                mean = pending.wait()
                member.clock.t = max(member.clock.t, *member.posted[tag].values())
                return mean

        return _Pending()


launches_by_fragment: list[dict[int, list[tuple[int, float]]]] = []


def _run(costs: list[float], seconds: float, rounds: int, starts: list[float] | None = None, **engine_kw):
    """Train one linear model per group for ``rounds`` time rounds; returns the engines, the
    weights each exchange saw, the clocks and each group's inner steps at every launch
    (fragment 0's; ``launches_by_fragment`` holds every fragment's)."""
    groups = InProcessGroups(len(costs), weighted=True)
    posted: dict = {}
    engines, clocks, launches = [None] * len(costs), [_Clock() for _ in costs], [[] for _ in costs]
    for clock, start in zip(clocks, starts or []):  # when each group builds its engine
        clock.t = start
    launches_by_fragment.clear()
    launches_by_fragment.extend({} for _ in costs)
    errors = []
    models = []
    for _ in costs:  # in the main thread: the global RNG is not per thread
        torch.manual_seed(0)
        models.append(nn.Linear(4, 1))

    def group(g: int) -> None:
        try:
            model = models[g]
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            engine = DiLoCo(model, opt, averager=_ClockedMember(groups.member(g), clocks[g], posted),
                            sync_every=TimeRounds(seconds, rounds), clock=clocks[g], **engine_kw)
            engines[g] = engine
            gen = torch.Generator().manual_seed(g)
            while not engine.rounds_done:
                x = torch.randn(8, 4, generator=gen)
                loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                clocks[g].t += costs[g]
                for e in engine.step():
                    if e.kind == "launch":
                        launches_by_fragment[g].setdefault(e.fragment, []).append((engine.inner_step, clocks[g].t))
                        if e.fragment == 0:
                            launches[g].append(engine.inner_step)
            engine.close()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=group, args=(g,)) for g in range(len(costs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return engines, groups.weights, clocks, launches


def test_a_slow_and_a_fast_group_end_their_rounds_together_weighted_by_their_steps():
    engines, weights, clocks, launches = _run([1.0, 2.0], seconds=10.0, rounds=3)
    # the fast group does 10 steps a round, the slow one 5 (it ends within half its step of 10 s)
    assert launches == [[10, 20, 30], [5, 10, 15]]
    assert [weights[f"f0/r{r}"] for r in range(3)] == [[10.0, 5.0]] * 3
    assert clocks[0].t == clocks[1].t == 30.0  # nobody waited: both ended each round at its deadline
    assert engines[0].global_hash() == engines[1].global_hash()
    assert [e.round for e in engines] == [3, 3] and all(e.rounds_done for e in engines)
    assert [e.round_steps for e in engines] == [[10, 10, 10], [5, 5, 5]]


def test_a_weighted_in_process_mean_weighs_each_contribution():
    groups = InProcessGroups(2, weighted=True)
    a, b = groups.member(0), groups.member(1)
    pa = a.start(torch.tensor([1.0, 0.0]), tag="x", weight=3.0)
    pb = b.start(torch.tensor([5.0, 4.0]), tag="x", weight=1.0)
    assert torch.equal(pa.wait(), torch.tensor([2.0, 1.0])) and torch.equal(pb.wait(), torch.tensor([2.0, 1.0]))
    with pytest.raises(ValueError, match="weight"):
        a.start(torch.zeros(2), tag="y", weight=-1.0)


def test_uneven_deadline_overshoot_makes_the_fast_group_wait_at_most_half_a_slow_step():
    # the slow group's 3 s steps cannot land on 10 s: it ends at 9 (one more would end at 12)
    _, weights, clocks, launches = _run([1.0, 3.0], seconds=10.0, rounds=2)
    assert launches == [[10, 20], [3, 6]]
    assert weights["f0/r1"] == [10.0, 3.0]
    assert clocks[0].t == clocks[1].t == 20.0


def test_time_rounds_refuse_what_they_do_not_support():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = InProcessGroups(1, weighted=True)
    for mode in ("eager", "delayed", "co2"):
        with pytest.raises(ValueError, match="rounds by time run with mode blocking or overlap, not"):
            DiLoCo(model, opt, averager=groups.member(0), sync_every=TimeRounds(1.0, 2), mode=mode)


@pytest.mark.parametrize("mode", ["overlap", "blocking"])
def test_streaming_fragments_by_time_stagger_and_the_fast_group_never_waits(mode):
    """Two fragments, overlap (tau 1) or blocking, a fast group (1 s steps) and a slow one (2 s):
    fragment 0's rounds end at 5, 15, 25 s and fragment 1's at 10, 20, 30 s. The slow group ends
    each round within half its step of the deadline; in overlap nobody waits for anyone (its
    exchange lands a step later), in blocking it waits for the fast group's contribution. Each
    contribution weighs the steps since its fragment's last launch; the groups end identical."""
    kw = {"mode": mode, "fragments": [["weight"], ["bias"]], **({"overlap_steps": 1} if mode == "overlap" else {})}
    engines, weights, clocks, _ = _run([1.0, 2.0], seconds=10.0, rounds=3, **kw)
    fast, slow = launches_by_fragment
    assert fast == {0: [(5, 5.0), (15, 15.0), (25, 25.0)], 1: [(10, 10.0), (20, 20.0), (30, 30.0)]}
    if mode == "overlap":  # the slow group launches at its last step before each deadline and goes on
        assert slow == {0: [(2, 4.0), (7, 14.0), (12, 24.0)], 1: [(5, 10.0), (10, 20.0), (15, 30.0)]}
        assert weights["f0/r0"] == [5.0, 2.0] and all(weights[f"f{p}/r{r}"] == [10.0, 5.0]
                                                       for p, r in ((1, 0), (0, 1), (1, 1), (0, 2), (1, 2)))
    else:  # it waits at each launch for the fast group (half a slow step), then starts the next round
        assert [t for _, t in slow[0]] == [5.0, 15.0, 25.0] and [t for _, t in slow[1]] == [10.0, 20.0, 30.0]
        assert weights["f0/r0"] == [5.0, 2.0] and weights["f1/r2"] == [10.0, 4.0]
    assert clocks[0].t == clocks[1].t == 30.0
    assert engines[0].global_hash() == engines[1].global_hash()
    assert all(e.rounds_done for e in engines) and [e.rounds for e in engines] == [[3, 3], [3, 3]]
    assert engines[0].round_steps == [5, 10, 10]  # fragment 0's rounds


def test_rounds_by_time_count_from_the_initial_exchange_that_every_group_leaves_together():
    """Group 1 builds its engine 3 s after group 0 (a slower start); the initial exchange makes
    group 0 wait for it, and both grids start there: every launch at the same instants."""
    _run([1.0, 1.0], seconds=10.0, rounds=2, starts=[0.0, 3.0], mode="overlap", fragments=[["weight"], ["bias"]],
         overlap_steps=1)
    fast, late = launches_by_fragment
    assert [t for _, t in fast[0]] == [t for _, t in late[0]] == [8.0, 18.0]
    assert [t for _, t in fast[1]] == [t for _, t in late[1]] == [13.0, 23.0]


def test_a_group_that_heals_into_overlapping_time_rounds_takes_the_members_grid():
    """adopt() of fragment 1's exchange committed at t=23 (2 fragments, 10 s rounds): the healer's
    next rounds end where the members' do, fragment 0 at 28 s, fragment 1 at 33 s."""
    model = nn.Linear(4, 1)
    clock = _Clock()
    engine = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), averager=InProcessGroups(1, weighted=True)
                    .member(0), sync_every=TimeRounds(10.0, 5), mode="overlap", overlap_steps=1,
                    fragments=[["weight"], ["bias"]], clock=clock)
    for frag, launched in zip(engine.fragments, [3, 2]):  # as loaded from a member launching f1/r2 (fragment 0
        frag.round = launched  # launched its round 2 already)

    class _Done:
        def wait(self):
            return torch.zeros(1)

    clock.t = 24.0
    engine.adopt("f1/r2", _Done(), committed_at=23.0)
    assert [s + 10.0 for s in engine.round_clock.round_start] == [28.0, 33.0]
    assert engine.progress() == pytest.approx((24.0 + 7.0) / 50.0)  # the members' grid began at -7 s


def test_overlapping_time_rounds_progress_from_the_start_of_the_grid():
    """The inner lr follows progress: in overlap it runs from 0 at the start (not from fragment
    0's half-round offset, which skipped the warmup's first steps) to 1 at the last round's end."""
    model, clock = nn.Linear(4, 1), _Clock()
    engine = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), averager=InProcessGroups(1, weighted=True)
                    .member(0), sync_every=TimeRounds(10.0, 3), mode="overlap", overlap_steps=1,
                    fragments=[["weight"], ["bias"]], clock=clock)
    assert engine.progress() == 0.0
    clock.t = 15.0
    assert engine.progress() == pytest.approx(0.5)
    clock.t = 40.0
    assert engine.progress() == 1.0


def test_round_vote_overrides_each_ranks_own_verdict():
    """A group of several ranks: every rank ends the round where the vote says, whatever its clock."""
    clock = _Clock()
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    votes = []

    def vote(mine: bool) -> bool:
        votes.append(mine)
        return len(votes) == 3  # "rank 0" says: end at the third step

    engine = DiLoCo(model, opt, averager=InProcessGroups(1, weighted=True).member(0),
                    sync_every=TimeRounds(100.0, 1), clock=clock, round_vote=vote)
    for _ in range(3):
        clock.t += 1.0
        events = engine.step()
    assert votes == [False, False, False]
    assert [e.kind for e in events] == ["launch", "commit"] and engine.rounds_done
