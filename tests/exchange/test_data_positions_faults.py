"""Every sample counted once, end to end in one process (the groups of test_fault_tolerance, each
drawing numbered samples from a resumable data source through the worker's DataFeed): across a
killed group that heals, a round rolled back by a corrupted frame, a refused (NaN) contribution,
and a stop/resume from rank checkpoints. The truth is counted from the samples each group actually
trained and the commits it saw; it must tile every group's stream with no sample twice and none
left out, and agree with the mechanism's own ledger (``DataPositions.ledger``)."""

from __future__ import annotations

import time

import pytest
import test_fault_tolerance as ft
import torch
from diloco_helpers import position_records

import diloco
from diloco.coordinator import CoordinatorServer
from diloco.exchange.data_positions import check_ledger, ledger_from_logs
from diloco.job.task import Task
from diloco.runtime.checkpoints import rank_state
from diloco.runtime.ops import logs
from diloco.runtime.rank.data_feed import DataFeed
from transport import FaultProxy

BATCH = 4


class Numbered:
    """A user's resumable source: group sample i is a fixed (x, y) pair; each batch carries its ids."""

    samples_per_step = BATCH

    def __init__(self, group: int) -> None:
        self.group, self.samples = group, 0

    def __iter__(self) -> Numbered:
        return self

    def __next__(self):
        ids = torch.arange(self.samples, self.samples + BATCH)
        self.samples += BATCH
        x = torch.stack([torch.randn(8, generator=torch.Generator().manual_seed(100_000 * self.group + int(i)))
                         for i in ids])
        return ids, x, x.sum(dim=1, keepdim=True).sin()

    def state(self) -> dict:
        return {"group": self.group, "samples": self.samples}

    def load_state(self, state: dict) -> None:
        assert state["group"] == self.group
        self.samples = int(state["samples"])


class Counting(ft.Group):
    """A group of test_fault_tolerance that draws from ``Numbered`` through a DataFeed and counts,
    from what it trained and the commits it saw, the sample ids its committed contributions hold.
    ``stop_at``: capture a rank checkpoint after that step and leave; ``checkpoint_at``: capture one
    and go on; ``resume``: start from one."""

    def __init__(self, address: str, group: int, *, stop_at: int | None = None, checkpoint_at: int | None = None,
                 resume: dict | None = None, **kw) -> None:
        super().__init__(address, group, **kw)
        self.stop_at, self.checkpoint_at, self.resume = stop_at, checkpoint_at, resume
        self.source = Numbered(group)
        self.committed: list[int] = []  # the truth: ids in contributions that committed with weight > 0
        self.pending: list[int] = []  # trained since this group's last launch
        self.launched: dict[int, list[int]] = {}  # round -> ids of the contribution in flight
        self.checkpoint: dict | None = None
        self.ledger: list[tuple[int, int]] = []

    @property
    def uncommitted(self) -> list[int]:
        return [i for ids in self.launched.values() for i in ids] + self.pending

    def count(self, events, refused_before: int) -> None:
        """A launch takes the samples trained since the last one; its commit counts them unless
        this group's contribution was refused meanwhile (the exchange lands later in overlap)."""
        for e in events:
            if e.kind == "launch":
                self.launched[e.round], self.pending = self.pending, []
            elif e.kind == "commit":
                ids = self.launched.pop(e.round, [])  # a healer's first round: nothing of its own
                if len(self.link.fault_stats.rejected) == refused_before:
                    self.committed += ids

    def _train(self) -> None:
        opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.engine = diloco.DiLoCo(self.model, opt, averager=self.link, sync_every=ft.H, mode=self.mode)
        task = Task(model=self.model, train_batches=self.source, loss=lambda m, b: b)
        feed = DataFeed(self.source, self.link.averager.positions, group=self.group)
        if self.resume is not None:
            rank_state.restore(self.resume["state"], engine=self.engine, model=self.model, inner=opt, task=task)
            feed.resumed(self.resume["state"])
            self.pending = list(self.resume["pending"])
        elif self.link.fault_stats.healed:
            feed.healed()
        self.ledger = self.link.averager.positions.ledger
        self.start_step = self.engine.inner_step
        for t in range(self.engine.inner_step, ft.STEPS):
            if self.killed.is_set() or t == self.die_at:
                return self.kill()
            ids, x, y = feed.next()
            self.pending += ids.tolist()
            self.inner_step(opt, x, y, t)
            refused = len(self.link.fault_stats.rejected)
            events = self.engine.step()
            feed.after_step()
            self.count(events, refused)
            if t + 1 in (self.stop_at, self.checkpoint_at):
                assert not self.launched  # blocking: nothing in flight between steps
                self.checkpoint = {"pending": list(self.pending), "committed": len(self.committed),
                                   "state": rank_state.capture(step=t + 1, cfg=None, engine=self.engine,
                                                               model=self.model, inner=opt, task=task,
                                                               data_positions=self.link.averager.positions.state)}
                if t + 1 == self.stop_at:
                    return
        self.count(self.engine.close(), len(self.link.fault_stats.rejected))
        self.final_hash = self.engine.global_hash()


def assert_counted_once(incarnations: dict[int, list[Counting]]) -> dict[int, int]:
    """The truth and the mechanism's ledger both tile [0, end) of every group's stream exactly
    once, with the same end (its committed position); returns the ends by group."""
    ledger = check_ledger({g: [r for run in runs for r in run.ledger] for g, runs in incarnations.items()})
    ends = {}
    for g, runs in incarnations.items():
        truth = sorted(i for run in runs for i in run.committed)
        end = runs[-1].link.averager.positions.committed_samples()
        assert truth == list(range(end)), (g, end, [i for i in range(end) if truth.count(i) != 1][:20])
        assert ledger[g].ok and ledger[g].counted == ledger[g].end == end, ledger[g]
        ends[g] = end
    return ends


@pytest.fixture
def coordinator():
    server = CoordinatorServer("127.0.0.1", 0, expected_groups=3, heartbeat_timeout_s=ft.HEARTBEAT_S,
                               join_timeout_s=30.0)
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("mode", ["blocking", "overlap"])
def test_every_sample_counted_once_across_a_kill_and_heal_a_rollback_and_a_refused_round(coordinator, mode):
    """Overlap (one fragment, tau=1): the exchange lands a step after its launch; a refusal there is
    redrawn only approximately (docs/fault_tolerance.md 4.1), so no NaN round in that mode."""
    proxies: list[FaultProxy] = []

    def through_proxy(link) -> None:  # a flipped byte mid-job: the round rolls back and is retried
        target = link.membership.ranks(1)[0]
        proxies.append(FaultProxy(target))
        link.transport.dial_overrides[target] = proxies[0].address
        proxies[0].corrupt(at_offset=ft.OFFSET, direction="up")

    blocking = mode == "blocking"
    first = [Counting(coordinator.address, 0, mode=mode, on_connected=through_proxy).start(),
             Counting(coordinator.address, 1, mode=mode, poison_at=10 if blocking else None).start(),
             Counting(coordinator.address, 2, mode=mode, die_at=13).start()]
    try:
        first[2].join()
        time.sleep(0.5)
        healer = Counting(coordinator.address, 2, mode=mode).start()
        ft.finish([first[0], first[1], healer])
        assert proxies[0].bytes_corrupted == 1
    finally:
        for p in proxies:
            p.close()
    assert len({g.final_hash for g in (first[0], first[1], healer)}) == 1
    assert healer.link.fault_stats.healed
    assert blocking == any("NaN" in w for w in first[1].link.fault_stats.rejected)
    assert sum(g.link.fault_stats.rollbacks for g in first) >= 1
    assert first[2].uncommitted  # the killed group died with trained, uncommitted samples ...
    assert healer.committed[0] == min(first[2].uncommitted)  # ... which its healer trained again
    ends = assert_counted_once({0: [first[0]], 1: [first[1]], 2: [first[2], healer]})
    # the refused round's samples were trained again, so group 1's stream is one round behind;
    # group 2 lost the steps it was down for, not samples
    assert ends[0] == ft.STEPS * BATCH and ends[1] == (ft.STEPS - (ft.H if blocking else 0)) * BATCH
    assert ends[2] == len(first[2].committed) + (ft.STEPS - healer.start_step) * BATCH


def resume_all(first: list[Counting]) -> list[Counting]:
    """Every group of ``first`` resumed from its checkpoint under a new coordinator, run to the end."""
    server = CoordinatorServer("127.0.0.1", 0, expected_groups=3, heartbeat_timeout_s=ft.HEARTBEAT_S,
                               join_timeout_s=30.0)
    server.start()
    try:
        resumed = [Counting(server.address, g.group, resume=g.checkpoint).start() for g in first]
        ft.finish(resumed)
    finally:
        server.stop()
    return resumed


def test_every_sample_counted_once_across_a_stop_and_resume(coordinator):
    stop = 18  # H=4: mid-round, with samples trained but not yet committed
    first = [Counting(coordinator.address, g, stop_at=stop).start() for g in range(3)]
    ft.finish(first)
    assert all(g.checkpoint is not None and g.pending for g in first)
    assert all(g.checkpoint["state"]["data"]["samples"] == stop * BATCH for g in first)
    resumed = resume_all(first)
    assert len({g.final_hash for g in resumed}) == 1
    assert all(g.engine.inner_step == ft.STEPS for g in resumed)
    ends = assert_counted_once({g.group: [g, r] for g, r in zip(first, resumed)})
    assert ends == {g: ft.STEPS * BATCH for g in range(3)}


def test_every_sample_counted_once_when_the_job_is_lost_and_resumes_from_an_earlier_checkpoint(coordinator):
    """Every group checkpoints at step 10, commits two more rounds, and dies at step 18: the job is
    lost. Resumed from the step-10 checkpoints, the groups train the lost rounds' samples again.
    The truth: what committed up to the checkpoint, then what the resumed groups committed. The
    ledger read from the logs of both runs must count each sample once."""
    with position_records() as records:
        first = [Counting(coordinator.address, g, checkpoint_at=10, die_at=18).start() for g in range(3)]
        for g in first:
            g.join()
        assert all(len(g.committed) > g.checkpoint["committed"] for g in first)  # commits the job then lost
        resumed = resume_all(first)
    assert len({g.final_hash for g in resumed}) == 1
    for r in records:
        r.component, r.group, r.rank = "worker", r.data_group, 0
    ledger = check_ledger(ledger_from_logs([logs.TextFormatter().format(r) for r in records]))
    for before, after in zip(first, resumed):
        truth = sorted(before.committed[:before.checkpoint["committed"]] + after.committed)
        assert truth == list(range(ft.STEPS * BATCH))
        assert ledger[before.group].ok and ledger[before.group].end == ft.STEPS * BATCH, ledger[before.group]


def test_a_plain_iterator_heals_from_its_start_and_counts_samples_twice(coordinator):
    """What the mechanism prevents, shown: a healed group whose data is a plain iterator starts
    it afresh (what every healer did before), so its first samples are committed twice."""
    first = [Counting(coordinator.address, g, die_at=13 if g == 2 else None).start() for g in range(3)]
    first[2].join()
    time.sleep(0.5)
    healer = Counting(coordinator.address, 2)
    healer.source = PlainStream(Numbered(2))
    healer.start()
    ft.finish([first[0], first[1], healer])
    twice = sorted(set(first[2].committed) & set(healer.committed))
    assert twice and twice[0] == 0


class PlainStream:
    """``Numbered`` behind a plain iterator (no position, no seek)."""

    def __init__(self, source: Numbered) -> None:
        self._source = source

    def __iter__(self) -> PlainStream:
        return self

    def __next__(self):
        return next(self._source)
