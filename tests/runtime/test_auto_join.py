"""--codec auto / --h auto in a group that joins a running job (it heals) or resumes one from its
checkpoints: no new decision; the group runs the job's setting (the coordinator's, or the
checkpoint's), and the schedule's state (the setting, the link it was decided on, the changes)
comes with the engine's, so the group decides alike from then on."""

import json
import threading

import pytest

from diloco import cli
from diloco.engine.schedule import FixedSchedule
from diloco.job import auto_choice as ac
from diloco.job.config import Config, ConfigError
from diloco.runtime.rank import auto_setting
from diloco.runtime.rank.auto_setting import AutoSchedule
from auto_pinned import pinned_table, shipped_best

SMALL = ["--n-layer", "1", "--n-embd", "64", "--block-size", "32", "--batch-size", "8", "--eval-batches", "2",
         "--warmup-steps", "5", "--no-progress", "--probe-bytes", "4096"]


class _Averager:
    def __init__(self) -> None:
        self._table = None
        self.setting = ""
        self.codecs: list = []

    def set_codec(self, codec) -> None:
        self.codecs.append(codec)


class _Link:
    def __init__(self) -> None:
        self.averager = _Averager()
        self.membership = type("M", (), {"groups": [0, 1], "ranks": lambda self, g: ["a"]})()
        self.metrics = type("X", (), {"auto_decided": lambda _, labels: None})()
        self.auto: dict = {}

    def pin(self, version: int, bytes_per_s: float) -> None:
        self.averager._table = (0, version, {0: {0: {1: bytes_per_s}}, 1: {0: {0: bytes_per_s}}})


def _auto_config() -> Config:
    cfg = Config()
    cfg.topology.groups, cfg.transport.codec, cfg.sync.h, cfg.transport.probe_bytes = 2, "auto", ac.AUTO_H, 4096
    return cfg.validate()


def test_a_schedule_loaded_from_a_donors_state_decides_as_the_donor_does():
    table = auto_setting.runnable_table(_auto_config(), pinned_table())
    n, step = 400_000, 0.1
    start = ac.choose(table, num_params=n, link_bytes_per_s=1e9, step_s=step, groups=2)
    cfg = ac.apply_choice(_auto_config(), start.setting).validate()
    donor_link = _Link()

    def schedule(link, choice, **kw):
        return AutoSchedule(FixedSchedule(choice.setting.h, total_steps=10_000), link, choice, table, num_params=n,
                            step_s=step, groups=2, codec=cfg.transport.codec_spec(), codec_fixed=False, **kw)

    donor = schedule(donor_link, start)
    donor_link.pin(2, 2e4)  # a slow link: another codec and H
    donor.period(30, 1e-3)
    assert donor.codec_changes and donor_link.averager.setting == donor.choice.setting.row != start.setting.row
    state = json.loads(json.dumps(donor.state_dict()))  # plain values: what a state blob or a checkpoint holds

    healer_link = _Link()
    placeholder = ac.Choice(start.setting, 0.0, 0.0, True, 0.0, 0.0, "placeholder")
    healer = schedule(healer_link, placeholder, waiting=True)
    healer_link.pin(2, 2e4)
    assert healer.period(0, 1e-3) == start.setting.h and not healer.codec_changes  # waits for the state
    healer.load_state_dict(state)
    assert healer.choice == donor.choice and healer.h == donor.h and healer.changes == donor.changes
    assert healer.codec_changes == donor.codec_changes and healer.decided_bytes_per_s == donor.decided_bytes_per_s
    assert healer_link.averager.setting == donor.choice.setting.row and len(healer_link.averager.codecs) == 1
    assert healer_link.auto["row"] == donor.choice.setting.row
    for version, bw in ((2, 2e4), (3, 2.1e4), (4, 1e9), (5, 3e5)):  # the same tables from here on
        for link in (donor_link, healer_link):
            link.pin(version, bw)
        assert healer.period(60 + version, 1e-3) == donor.period(60 + version, 1e-3)
        assert healer.choice.setting == donor.choice.setting
    assert healer.codec_changes == donor.codec_changes and len(donor.codec_changes) >= 2


def test_a_state_of_a_setting_the_table_lacks_is_refused():
    table = pinned_table()
    start = ac.choose(table, num_params=1000, link_bytes_per_s=1e9, step_s=0.1, groups=2)
    s = AutoSchedule(FixedSchedule(30), _Link(), start, table, num_params=1000, step_s=0.1, groups=2, waiting=True)
    with pytest.raises(ValueError, match="does not hold"):
        s.load_state_dict({**s.state_dict(), "row": "no-such-row"})
    with pytest.raises(ConfigError, match="these flags exclude"):
        auto_setting.running_setting(table, "slo-h30-d3", codec="int4")


def _run(tmp_path, name, *args, groups=2, ranks=1):
    out = tmp_path / f"{name}.json"
    assert cli.main(["run", *SMALL, "--groups", str(groups), "--ranks-per-group", str(ranks), *args,
                     "--json", str(out), "--run-dir", str(tmp_path / name)]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_killed_group_heals_into_an_auto_job_on_its_setting(tmp_path):
    """A group SIGKILLed in a --codec topk --h auto job (SparseLoCo, error feedback, tiles) restarts
    from a warm spare, learns the job's setting from the coordinator, builds its engine with it,
    takes the donor's state (schedule included, residual empty) and ends bit-identical with the
    others."""
    # the drill kills as soon as the groups are live (2-6 s after the start): on CI the healed group was back at
    # step ~240; 900 steps leave the kill well before the drill's last moment (80 %) and the heal well before the end
    s = _run(tmp_path, "heal", "--codec", "topk", "--h", "auto", "--steps", "900", "--chaos", "1", "--spares", "1",
             "--heartbeat-timeout", "2", "--timeout", "5", groups=3)
    assert s["fault"]["kills"] == 1 and s["fault"]["heals"] >= 1 and s["params_identical"]
    assert s["fault"]["spares_used"] == 1  # restarted from a warm spare (tests/runtime/test_spares.py)
    healed = [d for d in s["summaries"].values() if d["fault"]["healed"]]
    assert len(healed) == 1 and all(d["auto"]["row"] == s["auto"]["row"] for d in s["summaries"].values())
    assert healed[0]["auto"]["reason"] == s["auto"]["reason"]  # the donor's choice, not a placeholder
    log = (tmp_path / "heal" / f"group-{healed[0]['group']}.restart-1.log").read_text()
    assert s["auto"]["row"] == shipped_best("topk").row
    assert f"joins the job on {s['auto']['setting']} (the setting of the job's latest quorum)" in log
    assert all(d["twice"] == 0 and d["left_out"] == 0 for d in s["data_per_group"].values())


@pytest.mark.slow
@pytest.mark.parametrize("ranks,parallel", [(1, "auto"), (2, "fsdp")], ids=["replicated", "sharded"])
def test_an_auto_job_resumed_with_its_flags_equals_a_straight_run(tmp_path, ranks, parallel):
    """Stopped at a checkpoint and resumed with the same auto flags: no new measurement, the
    checkpoint's setting and schedule state, and the same parameters as a run never stopped.
    Sharded groups (FSDP2, 2 ranks each) checkpoint through DCP, the schedule in its engine.json;
    their choice is among the dense codecs (SparseLoCo's tiles need whole tensors)."""
    codec = "topk" if parallel != "fsdp" else "auto"
    flags = ["--codec", codec, "--h", "auto", "--steps", "120", "--parallel", parallel]
    if ranks > 1:
        flags += ["--backend", "gloo"]  # a 1-GPU host refuses two NCCL ranks of a group on its one GPU
    runs: dict = {}  # the straight run goes alongside the stopped one: most of a run's wall time is waiting
    thread = threading.Thread(target=lambda: runs.update(straight=_run(tmp_path, "straight", *flags, ranks=ranks)))
    thread.start()
    stopped = _run(tmp_path, "stopped", *flags, "--stop-after", "60", "--checkpoint-every", "60", ranks=ranks)
    root = tmp_path / "stopped" / "checkpoints"
    resumed = _run(tmp_path, "resumed", "--resume", str(root), "--codec", codec, "--h", "auto", ranks=ranks)
    thread.join(240)
    straight = runs["straight"]
    assert stopped["stopped_at_step"] == 60 and resumed["inner_steps"] == 120
    assert resumed["auto"]["row"] == stopped["auto"]["row"] == straight["auto"]["row"]
    assert resumed["param_hash_per_group"] == straight["param_hash_per_group"] and resumed["params_identical"]
    log = (tmp_path / "resumed" / "group-0.log").read_text()
    assert "(the setting of checkpoint step-000060)" in log
    assert parallel == "fsdp" or f"joins the job on {shipped_best('topk').label}" in log


def test_resuming_a_checkpoint_of_fixed_flags_under_auto_is_refused(tmp_path):
    """A worker given auto flags reads a checkpoint whose engine ran no auto schedule: refused,
    saying how to resume it (before any process would train)."""
    import torch

    from diloco.engine.averaging import SingleGroup
    from diloco.engine.diloco import DiLoCo
    from diloco.runtime.checkpoints import job_checkpoint, rank_state
    from diloco.runtime.checkpoints.checkpoint import CheckpointError

    fixed = Config()
    fixed.topology.groups, fixed.transport.codec, fixed.sync.h = 2, "topk", 30
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = DiLoCo(model, inner, averager=SingleGroup(), sync_every=30)
    state = rank_state.capture(step=0, cfg=fixed, engine=engine, model=model, inner=inner, group=0)
    assert state["engine"]["schedule"] is None and job_checkpoint.auto_row(state) is None
    job_checkpoint.write_rank(tmp_path, 0, 0, 0, state)
    job_checkpoint.write_manifest(tmp_path, 0, 0, 1, fixed, mode="blocking")
    with pytest.raises(CheckpointError, match="saved by a job of fixed flags"):
        job_checkpoint.load_rank(job_checkpoint.step_path(tmp_path, 0), _auto_config(), 0, 0)
