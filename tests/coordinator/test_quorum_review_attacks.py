"""A hostile review of issue 46's quorum rules (commit a7c5a5d), at protocol level: one member holds
ONE group's credential and sends any request for that group (any rank, any field), the other
groups are honest. Each test asserts the job's honest outcome, so a test that fails shows an attack
that works today (the sequence is in its docstring). The coordinator's state runs on a fake clock,
one-rank groups asking and voting from (daemon) threads, as in test_quorum_attacks.py."""

from __future__ import annotations

import threading
import time

import pytest

from diloco.coordinator.messages import (
    CommitRequest,
    HeartbeatRequest,
    JoinRequest,
    QuorumRequest,
    StateOffer,
)
from diloco.coordinator.quorum import QuorumError
from diloco.coordinator.rounds import HEAL, VETO_LIMIT
from diloco.coordinator.state import CoordinatorState
from round_helpers import FakeClock, formed, run_exchange, vote

DIGEST = "ab" * 32


def asking(state, group: int, exchange: int, out: dict, *, rank: int = 0, key=None, **fields) -> threading.Thread:
    """Group ``group`` rank ``rank`` asks for ``exchange`` in a daemon thread; the answer (or the
    QuorumError) lands in ``out[key or group]``."""

    def run() -> None:
        try:
            out[key if key is not None else group] = state.quorum(QuorumRequest(
                group, rank, "", exchange, **{"tag": f"f0/r{exchange}", "numel": 4, "weight": 1.0, **fields}),
                deadline=1e9)
        except QuorumError as e:
            out[key if key is not None else group] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def tick(state, clock, seconds: float, groups, *, steps: int = 1) -> None:
    """Move the clock by ``seconds`` in ``steps`` steps, every group of ``groups`` heartbeating
    (alive, training) after each, and let the waiting calls look again."""
    for _ in range(steps):
        clock.now += seconds / steps
        for g in groups:
            try:
                state.heartbeat(HeartbeatRequest(g, 0, 1))
            except QuorumError:
                pass
        time.sleep(0.3)


def forge_vote(state, req: CommitRequest):
    """The liar's vote ``req``, from a daemon thread: its answer, its error, or None while it waits."""
    out: dict = {}

    def run() -> None:
        try:
            out["r"] = state.commit(req, deadline=1e9)
        except QuorumError as e:
            out["r"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=2)
    return out.get("r")


def rounds_state(state) -> dict:
    return state.snapshot()["rounds_state"]


@pytest.fixture
def closing():
    """Close every state a test made, so no waiting call outlives it."""
    made: list[CoordinatorState] = []
    yield made.append
    for s in made:
        s.close()


# --- 1. a vote on a made-up quorum commits an exchange on one group's word ---------------------------


def test_a_forged_orphan_vote_cannot_commit_the_exchange_the_honest_groups_are_waiting_for(closing):
    """Attack: after exchange 0 committed, honest groups 1 and 2 ask for exchange 1. The liar (group 0)
    sends Commit(quorum_id="zz-1-0", exchange=1, groups=(0,), ok=True): an id without this
    coordinator's boot prefix is taken for a predecessor's (an orphan) even though this coordinator
    never restarted; a quorum of the liar alone whose every rank voted yes commits, which moves the
    frontier past 1 and makes it exchange 1's latest quorum, so the honest asks for 1 are evicted
    ("exchange 1 was already committed without it"). The liar is then the only live group: every
    honest group heals from it."""
    state, clock = formed(3, heartbeat_timeout_s=60.0)
    closing(state)
    run_exchange(state, range(3), 0)
    got: dict = {}
    for g in (1, 2):
        asking(state, g, 1, got)
    time.sleep(0.3)
    forged = forge_vote(state, CommitRequest(0, 0, "", "zz-1-0", 1, (0,), True, ""))
    time.sleep(0.3)
    assert isinstance(forged, QuorumError) and forged.code == "NOT_FOUND", forged
    assert not any(getattr(got.get(g), "evicted", "") for g in (1, 2)), (forged, got)
    assert rounds_state(state)["live_groups"] == [0, 1, 2], rounds_state(state)["failed_groups"]
    assert rounds_state(state)["frontier"] == 1


def test_after_a_coordinator_restart_a_forged_orphan_vote_cannot_move_the_frontier(closing):
    """Attack, restart flavour: a restarted coordinator has no frontier until an exchange commits. The
    groups rejoin at exchange 5 (``exchange=`` joins). The liar votes yes on an orphan quorum of
    itself alone for exchange 10**6: it commits, the frontier becomes 10**6 + 1, and every honest
    ask for exchange 5 is evicted as "committed long ago"."""
    clock = FakeClock()
    state = CoordinatorState(3, clock=clock, heartbeat_timeout_s=60.0)
    closing(state)
    joins = [threading.Thread(target=state.join, args=(JoinRequest(g, 0, 1, f"10.0.{g}.0:7000", f"i{g}", 5),),
                              kwargs={"deadline": 1e9}, daemon=True) for g in range(3)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(timeout=5)
    forged = forge_vote(state, CommitRequest(0, 0, "", "zz-1000000-0", 10**6, (0,), True, ""))
    got: dict = {}
    for t in [asking(state, g, 5, got) for g in range(3)]:
        t.join(timeout=5)
    assert all(not getattr(got.get(g), "evicted", "x") for g in range(3)), (forged, got)
    assert sorted(got[1].members) == [0, 1, 2]


# --- 2. the liar's early ask starts the clocks that judge the honest groups ---------------------------


def test_an_early_ask_does_not_make_honest_groups_that_train_a_long_round_stuck(closing):
    """Attack (works without any grace window): the liar asks for exchange 1 the moment exchange 0
    commits. The 'stuck' rule fails every live group that has not asked within the vote timeout
    (the join timeout: 120 s under diloco run) of the *first* ask, so once the honest groups' round
    takes longer than that (they heartbeat all along), both are failed and the liar runs exchange 1
    alone; the honest groups restart and heal from it."""
    state, clock = formed(3, heartbeat_timeout_s=60.0, join_timeout_s=20.0)
    closing(state)
    run_exchange(state, range(3), 0)
    got: dict = {}
    asking(state, 0, 1, got)  # the liar, at once
    tick(state, clock, 30.0, range(3), steps=6)  # the honest groups train a 30 s round, heartbeating
    assert rounds_state(state)["live_groups"] == [0, 1, 2], rounds_state(state)["failed_groups"]
    for t in [asking(state, g, 1, got) for g in (1, 2)]:
        t.join(timeout=5)
    assert sorted(got[1].members) == [0, 1, 2]


def test_start_up_skew_longer_than_the_join_timeout_is_not_a_fault(closing):
    """Honest corner case: the initial-parameter agreement is a control exchange; group 0 asks for it
    as soon as it joined, group 1 loads a large checkpoint for longer than the vote timeout
    (heartbeating). The 'stuck' rule fails group 1, although start-up skew is not a fault (the
    issue) and no grace window runs before the first training commit."""
    state, clock = formed(2, heartbeat_timeout_s=60.0, join_timeout_s=20.0)
    closing(state)
    got: dict = {}
    asking(state, 0, 0, got, healable=False)
    tick(state, clock, 25.0, (0, 1), steps=5)
    assert rounds_state(state)["live_groups"] == [0, 1], rounds_state(state)["failed_groups"]
    asking(state, 1, 0, got, healable=False).join(timeout=5)
    assert sorted(got[1].members) == [0, 1]


@pytest.mark.parametrize("groups", [3, 4])
def test_one_liar_cannot_halt_a_job_of_three_or_more_by_asking_with_a_forged_hash_while_others_train(groups, closing):
    """Attack: grace window on, exchange 0 committed (so the window runs). The liar asks for
    exchange 1 early with a forged state hash; the window ends while the honest groups train. The
    first honest ask meets the liar alone: rounds.decide returns the Disagreement (a 1-1 tie)
    before it checks that the askers are a majority of the live groups, so nothing waits for the
    others (fault_tolerance §2.1 says it does). Both re-ask at once, the window ends again before
    the other honest groups finish their round: the second Disagreement halts the job, in a job of
    any size, on one group's word."""
    state, clock = formed(groups, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    closing(state)
    run_exchange(state, range(groups), 0)
    got: dict = {}
    liar = asking(state, 0, 1, got, state_hash="h-forged")
    tick(state, clock, 1.0, range(groups))
    first = asking(state, 1, 1, got, state_hash="h-true")
    tick(state, clock, 1.0, range(groups))
    for t in (liar, first):
        t.join(timeout=1)
    if getattr(got.get(1), "disagreement", ""):  # the attempt rolled back: both ask again at once
        got.clear()
        liar = asking(state, 0, 1, got, state_hash="h-forged", retry=True)
        first = asking(state, 1, 1, got, state_hash="h-true", retry=True)
        tick(state, clock, 1.0, range(groups))
    others = [asking(state, g, 1, got, state_hash="h-true") for g in range(2, groups)]
    for t in (liar, first, *others):
        t.join(timeout=5)
    assert rounds_state(state)["halted"] is None
    assert got[0].evicted and not got[1].evicted and 1 in got[1].members and 0 not in got[1].members


def test_an_early_ask_does_not_shorten_the_grace_window_of_the_honest_groups(closing):
    """Attack: the window starts at the first ask, whoever sends it. The liar asks for exchange 1
    right after exchange 0 commits; the honest groups train 30 s; group 1 asks, and group 2 asks
    0.1 s later (well inside a 0.5 s window). The quorum forms on group 1's ask ({liar, 1} is a
    majority of 3), group 2 is left out: its round weighs 0 and the liar's share of the mean grows
    from 1/3 to 1/2. Repeated every exchange, the slower honest group never counts, and the liar
    (if lowest id) is the donor of every catch-up (next test)."""
    state, clock = formed(3, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    closing(state)
    run_exchange(state, range(3), 0)
    got: dict = {}
    threads = [asking(state, 0, 1, got)]
    tick(state, clock, 30.0, range(3), steps=3)
    threads.append(asking(state, 1, 1, got))
    time.sleep(0.3)
    clock.now += 0.1
    threads.append(asking(state, 2, 1, got))
    time.sleep(0.3)
    if 1 in got and 2 not in got[1].members:  # formed without group 2: vote, so its catch-up answers
        vote(state, got, (0, 1))
    for t in threads:
        t.join(timeout=5)
    assert sorted(got[1].members) == [0, 1, 2] and not got[2].catch_up


# --- 3. the catch-up and heal donor is the lowest id, and what it serves is its own word ------------


def test_a_catch_up_mean_is_anchored_to_the_honest_members_not_to_the_donors_word(closing):
    """Attack: group 2 is late and the window forms exchange 1 without it; the donor announces any
    digest for the 'committed mean' it serves group 2. The offer is released to group 2 only once
    a strict majority of the quorum's members vouch for that digest: the other member vouches for
    the mean it landed, which differs, so group 2 never takes the forged mean (its catch-up fails
    and it heals, from the state the majority agreed on). Two members vouching alike release it."""
    from diloco.coordinator.messages import OfferQuery

    state, clock = formed(3, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    closing(state)
    run_exchange(state, range(3), 0)
    got: dict = {}
    first = [asking(state, g, 1, got, state_hash="h0") for g in (0, 1)]
    tick(state, clock, 1.0, range(3))  # group 2 is honestly late: the window leaves it out
    for t in first:
        t.join(timeout=5)
    q = got[0]
    assert list(q.left_out) == [2]
    liar, other = q.donor, 1 - q.donor
    vote(state, got, (0, 1))
    state.offer(StateOffer(q.id, liar, 0, 2, 0, 64, "ee" * 32))  # the donor's forged digest
    state.offer(StateOffer(q.id, other, 0, 2, 0, 64, DIGEST))  # the other member vouches for the real one
    with pytest.raises(QuorumError, match="not vouched for by a majority") as info:
        state.wait_offer(OfferQuery(q.id, 2, 0), deadline=clock.now)  # the fake clock stands: no wait
    assert info.value.code == "DEADLINE_EXCEEDED"
    state.offer(StateOffer(q.id, liar, 0, 2, 0, 64, DIGEST))  # an honest donor's digest: both vouch alike
    assert state.wait_offer(OfferQuery(q.id, 2, 0), deadline=clock.now + 5).digest == DIGEST

def test_the_heal_donor_is_not_always_the_lowest_group_id(closing):
    """Attack: the donor of every heal (and catch-up) is the quorum's lowest member. A liar holding
    group 0 never serves (no OfferState): the healer's fetch fails, it asks HEAL again, and the
    next heal quorum names the liar as donor again, for ever: an honest group that restarted never
    heals back. A donor chosen by group id is a tie broken by group id."""
    state, clock = formed(3, heartbeat_timeout_s=60.0)
    closing(state)
    run_exchange(state, range(3), 0)
    restart = threading.Thread(target=state.join, args=(JoinRequest(2, 0, 1, "10.0.2.1:7000", "i2b"),),
                               kwargs={"deadline": 1e9}, daemon=True)
    restart.start()
    restart.join(timeout=5)
    donors = []
    for exchange in (1, 2):
        got: dict = {}
        threads = [asking(state, 2, HEAL, got)] + [asking(state, g, exchange, got) for g in (0, 1)]
        for t in threads:
            t.join(timeout=5)
        assert got[2].healers == (2,), got
        donors.append(got[2].donor)
        vote(state, got, (0, 1, 2))
        # the donor never offered: the healer's fetch failed; it asks to heal again in-process
    assert donors[0] != donors[1], donors


# --- 4. one group's word on fields nobody agrees on ----------------------------------------------


def test_one_member_saying_healable_false_cannot_keep_a_healer_out_of_every_quorum(closing):
    """Attack: the liar asks a training exchange with healable=False (as if it were a control
    exchange) to keep a restarted honest group from healing. The kind of exchange is agreed like
    the hash: against two honest members the liar is evicted and the healer joins; against one
    it is a disagreement (nobody is shut out silently)."""
    state, clock = formed(4, heartbeat_timeout_s=60.0)
    closing(state)
    run_exchange(state, range(4), 0)
    restart = threading.Thread(target=state.join, args=(JoinRequest(3, 0, 1, "10.0.3.1:7000", "i3b"),),
                               kwargs={"deadline": 1e9}, daemon=True)
    restart.start()
    restart.join(timeout=5)
    got: dict = {}
    healer = asking(state, 3, HEAL, got)
    for t in [asking(state, 0, 1, got, healable=False), asking(state, 1, 1, got), asking(state, 2, 1, got)]:
        t.join(timeout=5)
    healer.join(timeout=5)
    assert 3 in got[1].healers and "kind of exchange" in got[0].evicted, got

    state, clock = formed(3, heartbeat_timeout_s=60.0)
    closing(state)
    run_exchange(state, range(3), 0)
    restart = threading.Thread(target=state.join, args=(JoinRequest(2, 0, 1, "10.0.2.1:7000", "i2b"),),
                               kwargs={"deadline": 1e9}, daemon=True)
    restart.start()
    restart.join(timeout=5)
    got = {}
    asking(state, 2, HEAL, got)
    for t in [asking(state, 0, 1, got, healable=False), asking(state, 1, 1, got)]:
        t.join(timeout=5)
    assert "kind of exchange" in got[1].disagreement and "kind of exchange" in got[0].disagreement, got

def test_a_member_cannot_squat_the_address_of_a_failed_honest_group(closing):
    """Attack: addresses are each group's word and must be unique among current members. When
    honest group 2 fails (a crash), the liar restarts its own group with a second rank at group 2's
    address; group 2's restart, at its usual address, is then refused ("address ... is already
    used by group 0 rank 1") for the rest of the job."""
    state, clock = formed(3, heartbeat_timeout_s=10.0)
    closing(state)
    run_exchange(state, range(3), 0)
    tick(state, clock, 12.0, (0, 1), steps=3)  # group 2 crashed: silent past the heartbeat timeout
    assert 2 in rounds_state(state)["failed_groups"]
    refused: list = []

    def squat_join(rank: int, address: str) -> None:
        try:
            state.join(JoinRequest(0, rank, 2, address, "i0b"), deadline=clock.now + 5)
        except QuorumError as e:
            refused.append(e)

    squat = [threading.Thread(target=squat_join, args=a, daemon=True) for a in ((0, "10.0.0.0:7000"),
                                                                                 (1, "10.0.2.0:7000"))]
    for t in squat:
        t.start()
    for t in squat:
        t.join(timeout=5)
    out: dict = {}

    def rejoin() -> None:
        try:
            out["m"] = state.join(JoinRequest(2, 0, 1, "10.0.2.0:7000", "i2b"), deadline=clock.now + 5)
        except QuorumError as e:
            out["m"] = e

    t = threading.Thread(target=rejoin, daemon=True)
    t.start()
    t.join(timeout=5)
    assert not isinstance(out.get("m"), QuorumError), out
    assert any("belongs to group 2" in str(e) for e in refused), refused


# --- 5. votes: a tie in the vote is broken against the group that saw the failure -------------------


def test_in_two_groups_a_member_that_sabotages_its_rings_and_votes_yes_does_not_evict_the_honest_one(closing):
    """Attack: two groups. The liar breaks the rings towards the honest group and votes yes; the
    honest group's rings fail and it votes no. A 1-1 vote is a split, like a 1-1 hash disagreement:
    it blames nobody, and VETO_LIMIT splits in a row halt the job, naming both sides (exit 2),
    rather than evicting either group on the other's word."""
    state, clock = formed(2, heartbeat_timeout_s=60.0)
    closing(state)
    run_exchange(state, (0, 1), 0)
    for attempt in range(VETO_LIMIT):
        got: dict = {}
        for t in [asking(state, g, 1, got, retry=attempt > 0) for g in (0, 1)]:
            t.join(timeout=5)
        assert not got[1].evicted, (attempt, got[1].evicted)
        vote(state, got, (1,), ok=False)  # the honest group's rings failed (a no decides at once)
        vote(state, got, (0,), ok=True)
    got = {}
    for t in [asking(state, g, 1, got, retry=True) for g in (0, 1)]:
        t.join(timeout=5)
    for g in (0, 1):  # told as it waited (the answer), or as it asked (the error): halted either way
        assert getattr(got[g], "halted", False), got[g]
    halted = rounds_state(state)["halted"]
    assert "split evenly 3 attempts in a row" in halted and "groups [0] voted to commit" in halted, halted
    assert rounds_state(state)["failed_groups"] == {} and rounds_state(state)["evicted"] == 0

def test_after_a_coordinator_restart_a_group_with_an_exchange_committed_before_it_is_not_out_of_step(closing):
    """Honest corner case (overlap mode with fragments and a coordinator restart): exchanges 10 (f0)
    and 11 (f1) are in flight; the old coordinator committed 11 and rolled 10 back, then died. The
    groups rejoin the new one (``exchange=`` joins) and retry 10; it commits, so the new
    coordinator's frontier is 11 (it never heard of 11). Their next ask, 12, 'skips exchanges after
    exchange 10' (the skip rule reads the group's last ask *here*): every honest group is failed as
    out of step."""
    clock = FakeClock()
    state = CoordinatorState(2, clock=clock, heartbeat_timeout_s=60.0)
    closing(state)
    # a worker rejoins at its next exchange (``QuorumAverager.rejoin``: it asked for 10 and 11 already)
    joins = [threading.Thread(target=state.join, args=(JoinRequest(g, 0, 1, f"10.0.{g}.0:7000", f"i{g}", 12),),
                              kwargs={"deadline": 1e9}, daemon=True) for g in range(2)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(timeout=5)
    got = run_exchange(state, (0, 1), 10)
    assert sorted(got[0].members) == [0, 1] and rounds_state(state)["frontier"] == 11
    nxt: dict = {}
    for t in [asking(state, g, 12, nxt) for g in (0, 1)]:
        t.join(timeout=2)
    assert rounds_state(state)["live_groups"] == [0, 1], rounds_state(state)["failed_groups"]
    assert not isinstance(nxt.get(0), QuorumError), nxt


# --- rules that hold (coverage the commit's tests lack) ---------------------------------------------


def test_only_the_donor_may_offer_and_only_to_a_healer_or_a_left_out_group_and_no_one_votes_outside_its_quorum(closing):
    """Holds: a member that is not the quorum's donor only vouches for a digest (it releases nothing
    by itself), the left-out group cannot vouch for itself, the donor cannot offer to a group that
    is neither a healer nor left out, and a group votes only on this coordinator's quorums it
    belongs to; a vote on a made-up ('orphan') quorum is refused on a coordinator that did not
    restart."""
    from diloco.coordinator.messages import OfferQuery

    state, clock = formed(3, heartbeat_timeout_s=60.0, quorum_grace_s=0.5)
    closing(state)
    run_exchange(state, range(3), 0)
    got: dict = {}
    first = [asking(state, g, 1, got) for g in (0, 1)]
    tick(state, clock, 1.0, range(3))
    for t in first:
        t.join(timeout=5)
    q = got[0]
    other = 1 - q.donor
    assert list(q.left_out) == [2]
    state.offer(StateOffer(q.id, other, 0, 2, 0, 64, DIGEST))  # a witness: no offer to fetch yet
    with pytest.raises(QuorumError, match="no state offer"):
        state.wait_offer(OfferQuery(q.id, 2, 0), deadline=clock.now)  # the fake clock stands: no wait
    for bad in (StateOffer(q.id, 2, 0, 2, 0, 64, DIGEST), StateOffer(q.id, q.donor, 0, other, 0, 64, DIGEST)):
        with pytest.raises(QuorumError) as info:
            state.offer(bad)
        assert info.value.code == "INVALID_ARGUMENT"
    with pytest.raises(QuorumError, match="is not in quorum"):
        state.commit(CommitRequest(2, 0, "", q.id, 1, (0, 1, 2), False, "forged no"), deadline=1e9)
    with pytest.raises(QuorumError, match="unknown or too old") as info:
        state.commit(CommitRequest(2, 0, "", "zz-1-0", 1, (0, 1, 2), True, ""), deadline=1e9)
    assert info.value.code == "NOT_FOUND"
    vote(state, got, (0, 1))
    assert rounds_state(state)["committed"] == 2

