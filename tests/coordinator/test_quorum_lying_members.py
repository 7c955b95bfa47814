"""The quorum rules against members that lie (issue 46, point 1): pure rules, random liars.

Every input a member sends is its own word: its exchange, state hash, setting, size, weight, weight
cap and votes. Honest groups all say the same (the truth); liars say anything, alone or colluding.
For 2, 3, 4 and 8 groups the rules must never evict an honest group, never let a value held by no
more groups than the truth win, never break a tie by group id, and never let one group form a
quorum while another live group is heard from.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.coordinator.rounds import (
    MAX_EXCHANGES_AHEAD,
    Ask,
    Disagreement,
    Quorum,
    blamed,
    decide,
    own_share,
    weighted_scale,
    winner,
)
from diloco.engine.modes import MAX_FRAGMENTS
from diloco.job.config import Config, ConfigError

TRUTH = {"exchange": 5, "tag": "f0/r5", "numel": 100, "state_hash": "h-true", "setting": "", "weight_cap": 40.0}
SIZES = (1, 2, 4)


def honest(size: int, weight: float) -> Ask:
    return Ask(TRUTH["exchange"], TRUTH["tag"], TRUTH["numel"], weight, TRUTH["state_hash"], 1.0, True,
               TRUTH["setting"], TRUTH["weight_cap"], size)


# a liar's word: each field the truth or something else, drawn from a small pool so that liars collude
lie = st.fixed_dictionaries({
    "tag": st.sampled_from(["f0/r5", "f0/r5", "f1/r5"]),
    "numel": st.sampled_from([100, 100, 101]),
    "state_hash": st.sampled_from(["h-true", "h-x", "h-y", ""]),
    "setting": st.sampled_from(["", "", "slo-a"]),
    "weight_cap": st.sampled_from([40.0, 40.0, 1e300, 0.0, 80.0]),
    "weight": st.sampled_from([0.0, 1.0, 40.0, 1e12, 1e300, 1.7e308]),
})


def liar(word: dict, size: int) -> Ask:
    return Ask(TRUTH["exchange"], word["tag"], word["numel"], word["weight"], word["state_hash"], 1.0, True,
               word["setting"], word["weight_cap"], size)


@st.composite
def jobs(draw):
    """(asks, liars, live, heartbeating, sizes) of one exchange: n groups, fewer liars than honest
    groups or not, some honest groups perhaps not asked yet (live, heard from or silent)."""
    n = draw(st.sampled_from([2, 3, 4, 8]))
    liars = set(draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)))
    sizes = {g: draw(st.sampled_from(SIZES)) for g in range(n)}
    asked = {g for g in range(n) if g in liars or draw(st.booleans()) or g == 0}
    asks = {}
    for g in sorted(asked):
        if g in liars:
            asks[g] = liar(draw(lie), sizes[g])
        else:
            asks[g] = honest(sizes[g], draw(st.sampled_from([1.0, 10.0, 40.0])) * sizes[g])
    heard = {g for g in range(n) if g in asked or draw(st.booleans())}
    return asks, liars, set(range(n)), heard, sizes


def run(asks, live, heard, *, grace_over: bool = True):
    return decide(asks, live, next_exchange=TRUTH["exchange"], min_groups=1, attempt=0, quorum_id="q",
                  waited_s=10.0 if grace_over else 0.0, grace_s=0.5, heartbeating=heard)


@settings(max_examples=400, deadline=None)
@given(jobs())
def test_no_honest_group_is_evicted_while_the_honest_outnumber_the_liars(job):
    asks, liars, live, heard, _ = job
    honest_asked = [g for g in asks if g not in liars]
    result = run(asks, live, heard)
    if len(honest_asked) <= len(liars):
        return  # as many liars colluding as honest groups: nothing tells them apart
    assert not isinstance(result, Disagreement), result
    if isinstance(result, Quorum):
        assert not set(result.evicted) - liars, (result.evicted, liars)
        assert result.state_hash == TRUTH["state_hash"] and result.tag == TRUTH["tag"]
        assert result.numel == TRUTH["numel"] and result.setting == TRUTH["setting"]


@settings(max_examples=400, deadline=None)
@given(jobs())
def test_no_weight_above_what_the_group_can_have_trained_while_the_honest_outnumber_the_liars(job):
    asks, liars, live, heard, sizes = job
    result = run(asks, live, heard)
    if not isinstance(result, Quorum) or len(asks) - len(liars & set(asks)) <= len(liars):
        return
    for g, w in result.weights.items():
        assert w <= TRUTH["weight_cap"] * sizes[g], (g, w, asks[g])
        assert g not in result.rejected or w == 0.0
    scales = [weighted_scale(result.weights, g) for g in result.weights]
    assert all(math.isfinite(s) and s >= 0 for s in scales)


@settings(max_examples=400, deadline=None)
@given(jobs())
def test_one_group_never_forms_a_quorum_while_another_live_group_is_heard_from(job):
    asks, _, live, heard, _ = job
    result = run(asks, live, heard)
    if isinstance(result, Quorum) and result.left_out:  # formed without some live groups
        members = [g for g in result.groups if g not in result.healers]
        counted = set(members) | (set(result.left_out) & heard)
        assert 2 * len(members) > len(counted), (members, result.left_out, heard)
        assert len(members) > 1 or not (set(result.left_out) & heard)
    if not isinstance(result, Quorum) or result.left_out:
        return
    assert set(asks) >= live - set(result.left_out)  # without a window: every live group asked


@settings(max_examples=300, deadline=None)
@given(jobs(), st.randoms(use_true_random=False))
def test_no_group_id_breaks_a_tie_the_result_follows_a_renaming_of_the_groups(job, rnd):
    """Rename the groups at random: the same groups (renamed) are members, evicted and left out,
    and a disagreement stays a disagreement."""
    asks, _, live, heard, _ = job
    names = list(range(len(live)))
    rnd.shuffle(names)
    rename = dict(zip(sorted(live), names))
    before = run(asks, live, heard)
    after = run({rename[g]: a for g, a in asks.items()}, {rename[g] for g in live}, {rename[g] for g in heard})
    assert type(before) is type(after)
    if isinstance(before, Quorum):
        assert sorted(rename[g] for g in before.groups) == list(after.groups)
        assert {rename[g] for g in before.evicted} == set(after.evicted)
        assert sorted(rename[g] for g in before.left_out) == list(after.left_out)
        assert {rename[g]: w for g, w in before.weights.items()} == dict(after.weights)
    if isinstance(before, Disagreement):
        assert before.what == after.what and {rename[g]: v for g, v in before.values.items()} == dict(after.values)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([2, 3, 4, 8]), st.data())
def test_a_vote_blames_only_groups_that_more_members_contradict(n, data):
    """Honest members all vote alike (yes, or no when their ring broke); liars vote anything. An
    honest group is blamed only if liars voting the other way are at least as many as the honest."""
    liars = set(data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)))
    honest_ok = data.draw(st.booleans())
    sizes = {g: data.draw(st.sampled_from(SIZES)) for g in range(n)}
    votes = {}
    for g in range(n):
        for r in range(sizes[g]):
            if g in liars:
                if data.draw(st.booleans()):  # a liar may also not vote at all
                    votes[(g, r)] = (data.draw(st.booleans()), "liar")
            else:
                votes[(g, r)] = (honest_ok, "" if honest_ok else "ring broke")
    q = Quorum(id="q", exchange=5, attempt=0, tag="f0/r5", numel=100, groups=tuple(range(n)),
               weights={g: 1.0 for g in range(n)})
    out = blamed(q, sizes, votes)
    if len(liars) < n - len(liars):
        assert not out - liars, (out, liars, honest_ok)
    said_no = {g for g in range(n) if not all(votes.get((g, r), (False, ""))[0] for r in range(sizes[g]))}
    assert out <= said_no
    assert not out or len(out) <= n - len(said_no)  # never more blamed than the members that said yes


def test_winner_is_the_value_more_groups_hold_than_any_other_and_no_one_on_a_tie():
    assert winner({0: "a", 1: "a", 2: "b"}) == "a"
    assert winner({0: "b", 1: "a", 2: "a"}) == "a"
    assert winner({0: "a", 1: "b"}) is None and winner({0: "b", 1: "a"}) is None
    assert winner({0: "a", 1: "b", 2: "c"}) is None
    assert winner({0: "a", 1: "a", 2: "b", 3: "c"}) == "a"  # two of four, each other value once
    assert winner({3: "x"}) == "x"


def test_weights_up_to_the_largest_float_give_finite_shares():
    for big in (1e300, 1.7e308):
        weights = {0: big, 1: 1.0, 2: 1.0}
        assert math.isfinite(weighted_scale(weights, 0)) and 2.99 < weighted_scale(weights, 0) <= 3.0
        assert weighted_scale(weights, 1) < 1e-290 and own_share(weights, 0) <= 1.0
    weights = {0: 1.7e308, 1: 1.7e308}
    assert weighted_scale(weights, 0) == 1.0 and own_share(weights, 1) == 0.5


def test_an_honest_job_never_asks_beyond_the_coordinators_reach():
    """Each fragment keeps at most one exchange in flight (two with a control exchange between), so
    the engine's fragment limit keeps an honest group within the exchanges the coordinator accepts."""
    assert 2 * MAX_FRAGMENTS <= MAX_EXCHANGES_AHEAD
    cfg = Config()
    cfg.model.n_layer, cfg.sync.h, cfg.sync.fragments = 64, 640, MAX_FRAGMENTS + 1
    with pytest.raises(ConfigError, match=f"--fragments must be in \\[1, {MAX_FRAGMENTS}\\]"):
        cfg.validate()
