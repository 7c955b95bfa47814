"""--codec auto / --h auto in a real job: every group measures, agrees and picks the same setting
before the engine starts, switches its averager to that codec, and the groups stay bit-identical;
the choice and its reason reach the log, the summary, the status document and the metrics."""

import json
import re

import pytest

from diloco import cli
from diloco.runtime.launch import summary
from diloco.runtime.ops import status
from diloco.runtime.ops.metrics import WorkerMetrics
from auto_pinned import pinned_table, shipped_best

SMALL = ["--n-layer", "1", "--n-embd", "64", "--block-size", "32", "--batch-size", "8",
         "--eval-batches", "2", "--warmup-steps", "5", "--no-progress"]


@pytest.mark.slow
def test_two_groups_choose_the_same_sparse_setting_and_stay_bit_identical(tmp_path):
    """--codec topk --h auto on loopback: the link is fast, so the lowest measured loss among the
    study's top-k settings (at H=30 in every table so far); the averager, built with fp32 until the
    choice, then gathers top-k frames with error feedback."""
    best = shipped_best("topk")
    out, run = tmp_path / "summary.json", tmp_path / "run"
    code = cli.main(["run", *SMALL, "--steps", "60", "--groups", "2", "--ranks-per-group", "1", "--codec", "topk",
                     "--h", "auto", "--json", str(out), "--run-dir", str(run), "--probe-bytes", "4096"])
    assert code == 0
    s = json.loads(out.read_text())
    assert s["auto"]["row"] == best.row and s["auto"]["hides"] and best.h == 30
    assert s["periods"] == [30, 30] and s["params_identical"]
    hashes = s["round_hashes_per_group"]
    assert hashes["0"] == hashes["1"] and len(hashes["0"]) == 2
    # top-k frames gathered, not the fp32 ring the averager was built with: two fp32 rounds alone would
    # send 2 x 2 groups x 4 bytes per parameter, more than the whole job (probes and start included)
    assert s["bytes_sent"] < 2 * 2 * 4 * s["num_parameters"]
    lines = [re.search(r"auto: (.*)", line).group(1)
             for g in (0, 1) for line in (run / f"group-{g}.log").read_text().splitlines() if "] auto: " in line]
    assert len(lines) == 2 and lines[0] == lines[1] == s["auto"]["reason"]
    assert s["config"]["sync"]["h"] == "auto"
    assert f"auto (--codec/--h auto)  : {best.label}" in summary.format_summary(s)


@pytest.mark.slow
def test_a_paced_int2_choice_runs_its_plan_its_codec_options_and_its_last_codec(tmp_path):
    """--codec int2 --h auto on loopback: the lowest measured loss among the study's int2 settings is
    int2 in 1024-value blocks, zstd, no error feedback, 40 paced syncs and an int4 last exchange; the
    job runs all of it: the paced plan's periods, the int4 switch, groups bit-identical."""
    from diloco.engine.schedule import paced_sync_steps

    out, run = tmp_path / "summary.json", tmp_path / "run"
    code = cli.main(["run", *SMALL, "--steps", "400", "--groups", "2", "--ranks-per-group", "1", "--codec", "int2",
                     "--h", "auto", "--json", str(out), "--run-dir", str(run), "--probe-bytes", "4096"])
    assert code == 0
    s = json.loads(out.read_text())
    assert s["auto"]["row"] == "m2-paced200-int2b1024-int4final-decay0-zstd-outer" and s["params_identical"]
    plan = paced_sync_steps(400, 2, 0.5)
    assert s["periods"] == [plan[0], plan[1] - plan[0]] and plan[0] < 200
    log0 = (run / "group-0.log").read_text()
    assert "the last exchange (fragment 0, round 1, step 400) runs int4 without a residual" in log0
    assert "auto (--codec/--h auto)  : int2 b1024 zstd decay 0 then int4 paced 0.5 H=200" in summary.format_summary(s)


def test_status_and_metrics_show_the_choice():
    doc = {"groups": [{"group": 0, "joined": 1, "size": 1, "progress": {"step": 5, "auto": "int4 H=200: 41 s wire"}},
                      {"group": 1, "joined": 1, "size": 1, "progress": {"step": 5}}], "expected_groups": 2}
    text = status.format_status(doc)
    assert "auto (--codec/--h auto), group 0: int4 H=200: 41 s wire" in text and "group 1:" not in text
    m = WorkerMetrics(0, 0, codec="auto", link="tcp", zstd=False, chunk_bytes=1 << 20)
    try:
        from prometheus_client import generate_latest

        before = generate_latest(m.registry).decode()
        assert 'diloco_auto_info{group="0",rank="0",state="off"} 1.0' in before
        assert 'codec="auto"' in before
        assert 'diloco_codec_compression_ratio{group="0",rank="0"} 0.0' in before  # no codec yet
        m.auto_decided({"row": "m2-h200-int4-outer", "setting": "int4 H=200", "codec": "int4", "h": "200",
                        "mode": "blocking", "hides": "true", "reason": "why"})
        after = generate_latest(m.registry).decode()
        assert 'row="m2-h200-int4-outer"' in after and 'state="decided"' in after and 'codec="int4"' in after
        ratio = float(re.search(r'diloco_codec_compression_ratio\{group="0",rank="0"\} (\S+)', after).group(1))
        assert ratio > 7
    finally:
        m.close()


class _Link:
    """What AutoSchedule reads of a GroupConnection: the averager's pinned table, the members, metrics."""

    def __init__(self) -> None:
        self.averager = type("A", (), {"_table": None})()
        self.membership = type("M", (), {"groups": [0, 1], "ranks": lambda self, g: ["a"]})()
        self.shown: list[dict] = []
        self.metrics = type("X", (), {"auto_decided": lambda _, labels: self.shown.append(labels)})()
        self.auto: dict = {}

    def pin(self, version: int, bytes_per_s: float) -> None:
        self.averager._table = (0, version, {0: {0: {1: bytes_per_s}}, 1: {0: {0: bytes_per_s}}})


def test_h_follows_the_link_with_hysteresis_and_keeps_the_codec():
    from diloco.engine.schedule import FixedSchedule
    from diloco.job import auto_choice as ac
    from diloco.runtime.rank.auto_setting import AutoSchedule

    table = pinned_table()
    n, step = 400_000, 0.1
    start = ac.choose(table, num_params=n, link_bytes_per_s=1e9, step_s=step, groups=2, codec="topk")
    assert start.setting.row == "slo-h30-d3"
    link = _Link()
    h = AutoSchedule(FixedSchedule(30, total_steps=10_000), link, start, table, num_params=n, step_s=step, groups=2)
    assert h.period(0, 1e-3) == 30 and h.total_steps == 10_000
    link.pin(1, 0.8e9)  # within the hysteresis: nothing is re-decided
    assert h.period(30, 1e-3) == 30 and not h.changes and not link.shown
    link.pin(15, 0.4e9)  # a changed link that keeps H: re-decided (shown), no change of H
    assert h.period(45, 1e-3) == 30 and not h.changes and link.shown[-1]["h"] == "30"
    link.pin(2, 2e4)  # a slow link: the fewest bits of the same codec, density and outer rule
    assert h.period(60, 1e-3) == 100 and h.changes == [(60, 100, 2e4)]
    assert link.auto["row"] == "slo-h100-d3" and link.shown[-1]["codec"] == "topk" and link.shown[-1]["h"] == "100"
    assert link.auto["h_changes"] == [{"step": 60, "h": 100, "link_bytes_per_s": 2e4}]
    assert h.period(160, 1e-3) == 100  # the same table again: not re-decided
    link.pin(3, 1e9)
    assert h.period(260, 1e-3) == 30 and [c[1] for c in h.changes] == [100, 30]
    assert h.period(9_990, 1e-3) == 10  # capped by the steps that remain, as the fixed schedule is


def test_a_paced_setting_runs_its_plan_and_a_new_h_the_plan_of_that_h():
    """A paced setting syncs where ``PacedSchedule`` plans (not every H steps); when the link moves
    it to the same setting at another mean H, the rounds from then on follow that H's plan."""
    from dataclasses import replace

    from diloco.engine.schedule import (
        FixedSchedule,
        PacedSchedule,
        paced_sync_steps,
        planned_period,
        sync_steps,
    )
    from diloco.job import auto_choice as ac
    from diloco.runtime.rank.auto_setting import AutoSchedule

    study = pinned_table()
    paced = study.named("m2-paced200-int2b1024-int4final-decay0-zstd-outer")
    fewer = replace(paced, row="paced400", h=400, bits_per_param_per_step=paced.bits_per_param_per_step / 2,
                    loss_cost=paced.loss_cost + 0.01)  # the same bytes per exchange, half the syncs
    table = ac.AutoTable(study.size, study.study_dates, study.commit, study.regenerate, (paced, fewer))
    n, step = 19_000_000, 1.0
    start = ac.choose(table, num_params=n, link_bytes_per_s=1e9, step_s=step, groups=2)
    assert start.setting is paced
    link = _Link()
    s = AutoSchedule(PacedSchedule(200, 8000), link, start, table, num_params=n, step_s=step, groups=2)
    plan200, plan400 = paced_sync_steps(8000, 40, 0.5), paced_sync_steps(8000, 20, 0.5)
    assert sync_steps(s, [1e-3] * 8000) == list(plan200) and plan200[0] < 200 < plan200[-1] - plan200[-2]
    at = plan200[9]
    link.pin(2, 1e5)  # 0.8 Mbit/s: neither fits; the fewest bits per step is H=400
    assert s.period(at, 1e-3) == planned_period(plan400, at) and s.changes == [(at, 400, 1e5)]
    assert link.auto["row"] == "paced400"
    fixed = AutoSchedule(FixedSchedule(200, total_steps=8000), _Link(), start, table, num_params=n, step_s=step,
                         groups=2)
    with pytest.raises(TypeError, match="needs the run's paced schedule"):
        fixed.period(0, 1e-3)


class _Scripted:
    """An in-process group member whose 'pinned table' changes at a scripted exchange, as the
    coordinator's does for every group at once; AutoSchedule reads it after each launch."""

    def __init__(self, member, slow_from: int) -> None:
        self.member, self.slow_from, self.started = member, slow_from, 0
        self._table = None

    def __getattr__(self, name):
        return getattr(self.member, name)

    def start(self, flat, **kw):
        fast = self.started < self.slow_from
        bw = 1e9 if fast else 2e4
        self._table = (0, 1 if fast else 2, {0: {0: {1: bw}}, 1: {0: {0: bw}}})
        self.started += 1
        return self.member.start(flat, **kw)


def test_groups_switch_h_at_the_same_round_and_stay_bit_identical():
    """Two engines (top-k with error feedback) whose links slow down at the same exchange: both move
    from H=30 to H=100 at the same round, residuals and momentum carried, parameters identical."""
    import torch
    from diloco_helpers import build_in_threads, run_in_threads
    from torch import nn

    import compress
    from diloco.engine.averaging import InProcessGroups
    from diloco.engine.diloco import DiLoCo
    from diloco.job import auto_choice as ac
    from diloco.runtime.rank.auto_setting import AutoSchedule

    table = pinned_table()
    n = 437_760  # the demo GPT's parameters: what the decision weighs (the test model is smaller)
    start = ac.choose(table, num_params=n, link_bytes_per_s=1e9, step_s=0.1, groups=2, codec="topk")
    groups = InProcessGroups(2, codec=compress.get_codec("topk", chunk=64, k=4))
    scripted = [_Scripted(groups.member(i), slow_from=3) for i in range(2)]  # exchange 0: the initial check
    links = [_Link() for _ in range(2)]
    for link, s in zip(links, scripted):
        link.averager = s

    models = []
    for _ in range(2):  # seeded here, not in the threads: the global RNG is shared (a race gave them different weights)
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))

    def make(i):
        model = models[i]
        engine = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), averager=scripted[i], sync_every=30)
        engine.schedule = AutoSchedule(engine.schedule, links[i], start, table, num_params=n, step_s=0.1, groups=2)
        return engine

    engines = build_in_threads(make, 2)
    periods = [[], []]

    def work(i):
        e = engines[i]
        for t in range(330):
            g = torch.Generator().manual_seed(10_000 * i + t)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            e.inner_optimizer.zero_grad()
            nn.functional.mse_loss(e.model(x), y).backward()
            e.inner_optimizer.step()
            periods[i] += [ev.next_period for ev in e.step() if ev.kind == "launch"]
        e.close()

    run_in_threads(work, 2)
    assert periods[0] == periods[1] == [30, 30, 100, 100, 100]  # exchanges 1, 2 fast; 3 on slow
    assert [c[1] for c in engines[0].schedule.changes] == [100] and engines[0].schedule.changes == \
        engines[1].schedule.changes
    assert engines[0].global_hash() == engines[1].global_hash()


class _Relinked(_Scripted):
    """A member whose pinned table follows ``bandwidth(exchange)``; a new plan version at each change."""

    def __init__(self, member, bandwidth) -> None:
        super().__init__(member, slow_from=0)
        self.bandwidth, self.version, self._last = bandwidth, 0, None

    def start(self, flat, **kw):
        bw = self.bandwidth(self.started)
        if bw != self._last:
            self.version, self._last = self.version + 1, bw
        self._table = (0, self.version, {0: {0: {1: bw}}, 1: {0: {0: bw}}})
        self.started += 1
        return self.member.start(flat, **kw)


def test_with_codec_auto_groups_switch_codec_and_h_at_the_same_exchange_and_stay_bit_identical():
    """--codec auto --h auto: a fast link runs fp32 at H=100 (the study's best); when it slows at
    exchange 2 both groups move to int2 (error-fed) at H=300, and back to fp32 when it recovers at
    exchange 4, flushing the residual; the groups apply the same bits throughout."""
    import torch
    from diloco_helpers import build_in_threads, run_in_threads
    from torch import nn

    import compress
    from diloco.engine.averaging import InProcessGroups
    from diloco.engine.diloco import DiLoCo
    from diloco.job import auto_choice as ac
    from diloco.job.config import Config
    from diloco.runtime.rank.auto_setting import AutoSchedule

    table = pinned_table()
    n = 437_760
    start = ac.choose(table, num_params=n, link_bytes_per_s=1e9, step_s=0.1, groups=2)
    assert start.setting.row == "m2-h100-outer"
    groups = InProcessGroups(2, codec=compress.get_codec("fp32"))
    members = [_Relinked(groups.member(i), lambda x: 2e3 if x in (2, 3) else 1e9) for i in range(2)]
    links = [_Link() for _ in range(2)]
    for link, m in zip(links, members):
        link.averager = m
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))

    def make(i):
        model = models[i]
        engine = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), averager=members[i], sync_every=100)
        engine.schedule = AutoSchedule(engine.schedule, links[i], start, table, num_params=n, step_s=0.1, groups=2,
                                       engine=engine, codec=Config().transport.codec_spec(), codec_fixed=False, h_fixed=False)
        return engine

    engines = build_in_threads(make, 2)
    seen = [[], []]

    def work(i):
        e = engines[i]
        for t in range(1000):  # launches at steps 100, 200 (slow), 500 (slow), 800, 900, 1000
            g = torch.Generator().manual_seed(10_000 * i + t)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            e.inner_optimizer.zero_grad()
            nn.functional.mse_loss(e.model(x), y).backward()
            e.inner_optimizer.step()
            for ev in e.step():
                if ev.kind == "launch":
                    seen[i].append((ev.next_period, members[i].codec.name, e.error_feedback is not None))
        e.close()

    run_in_threads(work, 2)
    assert seen[0] == seen[1] == [(100, "fp32", False), (300, "int2", True), (300, "int2", True),
                                  (100, "fp32", False), (100, "fp32", False), (100, "fp32", False)]
    schedule = engines[0].schedule
    assert [(step, label) for step, label, _ in schedule.codec_changes] == [(200, "int2 H=300"), (800, "fp32 H=100")]
    assert schedule.codec_changes == engines[1].schedule.codec_changes
    assert links[0].auto["codec_changes"][0]["setting"] == "int2 H=300"
    assert engines[0].global_hash() == engines[1].global_hash()
