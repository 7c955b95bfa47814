"""Job checkpoints and resume: files and manifests, config rules, N + N steps == 2N steps bit for bit
(in-process groups, and a real `diloco run --stop-after` / `--resume`)."""

import json
import os
import shutil
import signal
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
from diloco_helpers import build_in_threads, run_in_threads

from diloco import cli
from diloco.demo import data
from diloco.demo.model import GPT, GPTConfig
from diloco.engine.averaging import InProcessGroups, SingleGroup
from diloco.engine.diloco import DiLoCo
from diloco.job import config_parse
from diloco.job.config import Config, ConfigError
from diloco.job.task import Task, TaskError
from diloco.runtime.checkpoints import job_checkpoint, rank_state
from diloco.runtime.checkpoints.checkpoint import CheckpointError
from diloco.runtime.checkpoints.job_checkpoint import CheckpointOptions
from diloco.runtime.launch import launcher
from diloco.runtime.rank import train_loop

G = 2
TOKENS = np.random.default_rng(0).integers(0, 32, 4000).astype(np.uint8)


def job_config(mode="blocking", groups=G, **train):
    cfg = Config()
    cfg.topology.groups, cfg.topology.ranks_per_group, cfg.sync.mode = groups, 1, mode
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


class Group:
    """One simulated group: a tiny GPT, AdamW, its own data sampler, a DiLoCo engine."""

    def __init__(self, model, index, averager, mode):
        self.model = model
        self.inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        self.sampler = data.BatchSampler(TOKENS, 4, 8, seed=100 + index)
        self.task = Task(model=model, train_batches=iter(()), loss=lambda m, b: m(b[0], b[1])[1],
                         data_state=self.sampler.state_dict, load_data_state=self.sampler.load_state_dict)
        kw = {"overlap_steps": 2, "fragments": 2} if mode == "overlap" else {}
        self.engine = DiLoCo(model, self.inner, averager=averager, sync_every=6 if mode == "overlap" else 3,
                             mode=mode, **kw)

    def train(self, start, stop):
        for _ in range(start, stop):
            loss = self.task.loss(self.model, self.sampler.next())
            self.inner.zero_grad(set_to_none=True)
            loss.backward()
            self.inner.step()
            self.engine.step()


def build(mode):
    models = []
    for _ in range(G):  # seeded here, not in the threads: the global RNG is shared
        torch.manual_seed(0)
        models.append(GPT(GPTConfig(32, 8, 2, 2, 16, 0.0)))
    groups = InProcessGroups(G)
    return build_in_threads(lambda i: Group(models[i], i, groups.member(i), mode), G)


def state_of(g):
    return {"global": g.engine.global_params, "local": list(g.model.state_dict().values()),
            "inner": [t for s in g.inner.state_dict()["state"].values() for t in s.values()],
            "data": [g.sampler.gen.get_state()]}


@pytest.mark.parametrize("mode, n", [("blocking", 4), ("overlap", 7)])
def test_n_steps_checkpoint_fresh_objects_n_steps_equals_2n_steps(tmp_path, mode, n):
    # blocking: H=3, cut mid-round; overlap: 2 fragments, H=6, tau=2: fragment 1 launched at 6 lands at 8
    straight = build(mode)
    run_in_threads(lambda i: straight[i].train(0, 2 * n), G)

    first = build(mode)
    run_in_threads(lambda i: first[i].train(0, n), G)
    if mode == "overlap":
        assert any(f is not None for f in first[0].engine.in_flight), "no exchange in flight at the cut"
    cfg = job_config(mode, checkpoint_dir=str(tmp_path), checkpoint_every=n)

    def save(i):
        g = first[i]
        keeper = job_checkpoint.JobCheckpointer(CheckpointOptions.of(cfg),
                                                group=i, rank=0, group_size=1, engine=g.engine, model=g.model,
                                                inner=g.inner, task=g.task, link=g.engine.averager)
        keeper.save(n, loss_ema=1.0)

    run_in_threads(save, G)
    assert job_checkpoint.latest_complete_step(tmp_path) == n

    resumed = build(mode)
    point = job_checkpoint.find(tmp_path)

    def load(i):
        got = job_checkpoint.load_rank(point.path, cfg, i, 0)
        g = resumed[i]
        progress = rank_state.restore(got.state, engine=g.engine, model=g.model, inner=g.inner, task=g.task)
        assert progress.step == n and progress.loss_ema == 1.0
        g.train(n, 2 * n)

    run_in_threads(load, G)
    for a, b in zip(straight, resumed):
        assert a.engine.inner_step == b.engine.inner_step == 2 * n and a.engine.rounds == b.engine.rounds
        for key, xs in state_of(a).items():
            ys = state_of(b)[key]
            assert len(xs) == len(ys) > 0
            assert all(torch.equal(x, y) for x, y in zip(xs, ys)), (mode, key)
    assert straight[0].engine.global_hash() == straight[1].engine.global_hash()


# --- files, manifests, lookup --------------------------------------------------------------------


def single(cfg):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = DiLoCo(model, inner, averager=SingleGroup(), sync_every=2)
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        inner.step()
        engine.step()
    return model, inner, engine


def write_step(root, step, groups=G, cfg=None):
    cfg = cfg or job_config(groups=groups)
    model, inner, engine = single(cfg)
    engine.inner_step = step
    for g in range(groups):
        state = rank_state.capture(step=step, cfg=cfg, engine=engine, model=model, inner=inner, group=g)
        job_checkpoint.write_rank(root, step, g, 0, state)
        job_checkpoint.write_manifest(root, step, g, 1, cfg, mode="blocking")
    return model, inner, engine


def test_round_trip_restores_every_part(tmp_path):
    cfg = job_config(groups=1)
    model, inner, engine = single(cfg)
    torch.manual_seed(77)
    np.random.seed(5)
    state = rank_state.capture(step=3, cfg=cfg, engine=engine, model=model, inner=inner, loss_ema=0.5,
                               initial_eval_loss=2.0)
    job_checkpoint.write_rank(tmp_path, 3, 0, 0, state)
    job_checkpoint.write_manifest(tmp_path, 3, 0, 1, cfg)
    expected = torch.rand(3), np.random.rand()
    point = job_checkpoint.find(tmp_path)
    assert (point.step, point.path.name, point.config.to_dict()) == (3, "step-000003", cfg.to_dict())

    fresh_model, fresh_inner, fresh_engine = single(cfg)
    with torch.no_grad():
        fresh_model.weight.zero_()
    fresh_engine.inner_step = 0
    got = job_checkpoint.load_rank(point.path, cfg, 0, 0)
    progress = rank_state.restore(got.state, engine=fresh_engine, model=fresh_model, inner=fresh_inner)
    assert (progress.step, progress.loss_ema, progress.initial_eval_loss) == (3, 0.5, 2.0)
    assert fresh_engine.inner_step == 3 and fresh_engine.next_sync == engine.next_sync
    assert torch.equal(fresh_model.weight, model.weight)
    assert torch.equal(fresh_inner.state_dict()["state"][0]["exp_avg"], inner.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected[0]) and np.random.rand() == expected[1]


def test_corrupt_file_is_an_error_naming_it(tmp_path):
    write_step(tmp_path, 4)
    path = tmp_path / "step-000004" / "group-1-rank-0.pt"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    cfg = job_config()
    job_checkpoint.load_rank(tmp_path / "step-000004", cfg, 0, 0)  # the other group's file is fine
    with pytest.raises(CheckpointError, match="group-1-rank-0.pt"):
        job_checkpoint.load_rank(tmp_path / "step-000004", cfg, 1, 0)
    with pytest.raises(CheckpointError, match="group-1-rank-0.pt: contents do not match"):
        job_checkpoint.verify_step(tmp_path / "step-000004")  # what diloco run --resume checks first


def test_cli_resume_refuses_a_corrupt_checkpoint_before_any_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launcher, "_spawn_group", lambda *a, **k: pytest.fail("a process was started"))
    write_step(tmp_path, 2)
    path = tmp_path / "step-000002" / "group-0-rank-0.pt"
    path.write_bytes(path.read_bytes()[:-1])
    assert cli.main(["run", "--resume", str(tmp_path), "--no-progress"]) == 2
    assert "group-0-rank-0.pt: contents do not match" in capsys.readouterr().err


def test_a_corrupt_newest_step_is_refused_naming_the_newest_intact_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launcher, "_spawn_group", lambda *a, **k: pytest.fail("a process was started"))
    for step in (2, 4, 6):
        write_step(tmp_path, step)
    for step in (4, 6):  # both newer steps are damaged: the hint names step 2
        path = tmp_path / f"step-{step:06d}" / "group-1-rank-0.pt"
        path.write_bytes(path.read_bytes()[:-1])
    assert cli.main(["run", "--resume", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "step-000006/group-1-rank-0.pt: contents do not match" in err
    assert f"the newest intact step before it is step-000002: diloco run --resume {tmp_path / 'step-000002'}" in err
    (tmp_path / "step-000002" / "group-0-rank-0.pt").write_bytes(b"x")
    assert cli.main(["run", "--resume", str(tmp_path), "--no-progress"]) == 2
    assert "no older step under it is intact" in capsys.readouterr().err


def test_a_step_without_every_manifest_is_ignored(tmp_path):
    write_step(tmp_path, 2)
    write_step(tmp_path, 4)
    (tmp_path / "step-000004" / "group-1.json").unlink()  # group 1 crashed before its manifest
    (tmp_path / "step-000006").mkdir()  # a crash before anything was written
    assert job_checkpoint.complete_steps(tmp_path) == [2]
    assert job_checkpoint.complete_steps(tmp_path, group=0) == [2, 4]
    assert job_checkpoint.latest_complete_step(tmp_path) == 2
    assert job_checkpoint.find(tmp_path).step == 2
    assert job_checkpoint.find(tmp_path, group=0).step == 2  # the whole job's newest first
    assert job_checkpoint.find(tmp_path / "step-000004", group=0).step == 4  # named: group 0's part is there
    with pytest.raises(CheckpointError, match="incomplete"):
        job_checkpoint.find(tmp_path / "step-000004")
    with pytest.raises(CheckpointError, match="group-1.json"):
        job_checkpoint.load_rank(tmp_path / "step-000004", job_config(), 1, 0)
    (tmp_path / "step-000002" / "group-0-rank-0.pt").unlink()  # listed, but gone
    assert job_checkpoint.latest_complete_step(tmp_path) is None
    with pytest.raises(CheckpointError, match="no complete job checkpoint"):
        job_checkpoint.find(tmp_path)


@pytest.mark.parametrize("change, flag", [
    (lambda c: setattr(c.sync, "mode", "overlap"), "--mode"),
    (lambda c: setattr(c.topology, "groups", 3), "--groups"),
    (lambda c: setattr(c.model, "n_layer", 4), "--n-layer"),
    (lambda c: setattr(c.train, "steps", 500), "--steps"),
])
def test_a_checkpoint_of_another_job_is_refused(tmp_path, change, flag):
    write_step(tmp_path, 2)
    cfg = job_config()
    change(cfg)
    with pytest.raises(CheckpointError, match=f"group-0-rank-0.pt: saved by a different job:\n.*{flag}"):
        job_checkpoint.load_rank(tmp_path / "step-000002", cfg, 0, 0)
    operational = job_config()
    operational.train.log_every, operational.transport.timeout_s = 1, 5.0
    job_checkpoint.load_rank(tmp_path / "step-000002", operational, 0, 0)


def test_resume_config_allows_only_settings_that_keep_the_math(tmp_path):
    saved = job_config(stop_after=40, checkpoint_every=20, checkpoint_dir="/old/place")
    saved.train.steps = 80
    cfg = job_checkpoint.resume_config(saved, {("train", "steps"): 80, ("train", "log_every"): 1}, tmp_path)
    assert (cfg.train.steps, cfg.train.log_every, cfg.train.stop_after) == (80, 1, 0)
    assert cfg.train.checkpoint_dir == str(tmp_path) and cfg.train.checkpoint_every == 20
    with pytest.raises(ConfigError, match=r"--steps: 160 asked, 80 in the checkpoint"):
        job_checkpoint.resume_config(saved, {("train", "steps"): 160}, tmp_path)
    with pytest.raises(ConfigError, match="--inner-lr"):
        job_checkpoint.resume_config(saved, {("inner", "lr"): 0.5}, tmp_path)
    with pytest.raises(ConfigError, match="--stop-after: 30 asked, but the checkpoint is at step 40"):
        job_checkpoint.resume_config(saved, {("train", "stop_after"): 30}, tmp_path, step=40)
    assert job_checkpoint.resume_config(saved, {("train", "stop_after"): 60}, tmp_path, step=40).train.stop_after == 60


def test_cli_resume_refuses_a_longer_schedule_before_any_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launcher, "_spawn_group", lambda *a, **k: pytest.fail("a process was started"))
    write_step(tmp_path, 2)
    assert cli.main(["run", "--resume", str(tmp_path), "--steps", "999", "--no-progress"]) == 2
    assert "--steps: 999 asked, 300 in the checkpoint" in capsys.readouterr().err


def test_prune_keeps_the_newest_and_touches_only_its_group(tmp_path):
    for step in (2, 4, 6, 8):
        write_step(tmp_path, step)
    assert job_checkpoint.prune(tmp_path, 0, keep=2) == [2, 4]
    assert job_checkpoint.complete_steps(tmp_path, group=0) == [6, 8]
    assert job_checkpoint.complete_steps(tmp_path, group=1) == [2, 4, 6, 8]
    job_checkpoint.prune(tmp_path, 1, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006", "step-000008"]


def test_prune_goes_on_when_another_group_removes_a_folder_it_listed(tmp_path, monkeypatch):
    """Two groups prune at the same checkpoint. A group that healed has fewer complete steps, so it
    prunes a step later than the others and its folders hold only its own files: the other group
    lists such a folder, the healed group removes it, and the other must not fail on it."""
    for step in (2, 4, 6):
        write_step(tmp_path, step)
    job_checkpoint.prune(tmp_path, 0, keep=2)  # step 2 now holds only group 1's files
    listed = job_checkpoint.step_folders

    def listed_then_removed(root):
        folders = listed(root)
        shutil.rmtree(job_checkpoint.step_path(tmp_path, 2))  # group 1 pruned its files and the folder
        return folders

    write_step(tmp_path, 8)
    monkeypatch.setattr(job_checkpoint, "step_folders", listed_then_removed)
    assert job_checkpoint.prune(tmp_path, 0, keep=2) == [4]
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000006", "step-000008"]
    assert job_checkpoint.complete_steps(tmp_path, group=0) == [6, 8]


# --- the worker's decisions, data position, cross-group step agreement ------------------------------


class FakeLink(SingleGroup):
    stop_requested = False


def test_checkpointer_writes_periodically_stops_at_stop_after_on_agreement_and_after_sigterm(tmp_path):
    cfg = job_config(groups=1, checkpoint_every=4, stop_after=10, checkpoint_dir=str(tmp_path))
    model, inner, engine = single(cfg)
    link = FakeLink()
    keeper = job_checkpoint.JobCheckpointer(CheckpointOptions.of(cfg),
                                            group=0, rank=0, group_size=1, engine=engine, model=model,
                                            inner=inner, task=None, link=link)

    def after(step):
        engine.inner_step = step
        return keeper.after_step(step, loss_ema=None)

    assert [after(s) for s in range(1, 10)] == [False] * 9
    assert job_checkpoint.complete_steps(tmp_path) == [4, 8]
    assert after(10) and job_checkpoint.complete_steps(tmp_path) == [4, 8, 10]
    link.stop_requested = True
    assert after(11) and job_checkpoint.complete_steps(tmp_path) == [8, 10, 11]  # keep 3
    link.stop_requested = False
    assert not after(13)
    if threading.current_thread() is threading.main_thread():  # SIGTERM: stop at the next periodic step
        before = signal.getsignal(signal.SIGTERM)
        try:
            train_loop.on_sigterm(keeper, 60.0)
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            signal.signal(signal.SIGTERM, before)
            if keeper.stop_timer is not None:
                keeper.stop_timer.cancel()  # its --stop-grace deadline would end this process (exit 75)
    else:
        keeper.request_stop()
    assert keeper.stop_signalled
    assert not after(14) and not after(15) and after(16)
    assert job_checkpoint.complete_steps(tmp_path)[-1] == 16
    with pytest.raises(ConfigError, match="not after"):
        job_checkpoint.JobCheckpointer(CheckpointOptions.of(cfg),
                                       group=0, rank=0, group_size=1, engine=engine, model=model,
                                       inner=inner, task=None, link=link, start_step=10)
    # a group that healed into the job at step s does what the others do after s: checkpoint, stop
    for start, stops in ((10, True), (8, False), (9, False)):
        engine.inner_step = start
        healer = job_checkpoint.JobCheckpointer(CheckpointOptions.of(cfg),
                                                group=0, rank=0, group_size=1, engine=engine, model=model,
                                                inner=inner, task=None, link=link, start_step=start, healed=True)
        assert healer.catch_up(loss_ema=None) is stops
        assert healer.last == (None if start == 9 else job_checkpoint.step_path(tmp_path, start))
    resumed = job_checkpoint.JobCheckpointer(CheckpointOptions.of(cfg),
                                             group=0, rank=0, group_size=1, engine=engine, model=model,
                                             inner=inner, task=None, link=link, start_step=4)
    assert resumed.catch_up(loss_ema=None) is False and resumed.last is None
    # a stop agreed in the exchange that started the job (SIGTERM during start-up): stop before the
    # first inner step, with a checkpoint there, not after step 1 (no exchange there)
    link.stop_requested = True
    cfg.train.checkpoint_dir = str(tmp_path / "early")
    for start in (0, 4):
        engine.inner_step = start
        early = job_checkpoint.JobCheckpointer(CheckpointOptions.of(cfg),
                                               group=0, rank=0, group_size=1, engine=engine, model=model,
                                               inner=inner, task=None, link=link, start_step=start)
        assert early.catch_up(loss_ema=None) is True
        assert early.last == job_checkpoint.step_path(tmp_path / "early", start)
    assert job_checkpoint.complete_steps(tmp_path / "early") == [0, 4]


def test_batch_sampler_continues_from_its_state():
    a = data.BatchSampler(TOKENS, 4, 8, seed=3)
    for _ in range(5):
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(3)]
    b = data.BatchSampler(TOKENS, 4, 8, seed=999)
    b.load_state_dict(state)
    got = [b.next() for _ in range(3)]
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(expected, got))
    with pytest.raises(data.DataError, match="sampler state"):
        data.BatchSampler(TOKENS, 2, 8, seed=3).load_state_dict(state)
    with pytest.raises(TaskError, match="go together"):
        Task(model=nn.Linear(1, 1), train_batches=[], loss=lambda m, b: b, data_state=a.state_dict)


def test_a_task_without_data_state_is_replayed():
    cfg = job_config(groups=1)
    model, inner, engine = single(cfg)
    state = rank_state.capture(step=3, cfg=cfg, engine=engine, model=model, inner=inner)
    stream = iter(range(100))
    rank_state.restore(state, engine=engine, model=model, inner=inner, task=None, batches=stream)
    assert next(stream) == 3
    with pytest.raises(ValueError, match="ran out after 2"):
        rank_state.restore(state, engine=engine, model=model, inner=inner, batches=iter(range(2)))


def test_groups_at_different_steps_all_refuse():
    groups = InProcessGroups(3)
    errors = []

    def work(i):
        rank_state.agree_on_step(groups.member(i), 40, tag="same")
        try:
            rank_state.agree_on_step(groups.member(i), 40 if i < 2 else 41, tag="differ")
        except ValueError as e:
            errors.append(str(e))

    run_in_threads(work, 3)
    assert len(errors) == 3 and all("not at the same step" in e for e in errors)


# --- end to end: diloco run --stop-after, then --resume, against a straight run --------------------

SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
         "--eval-batches", "2", "--warmup-steps", "2", "--h", "3", "--dropout", "0.1", "--groups", "2",
         "--ranks-per-group", "1", "--probe-bytes", "0", "--no-progress"]


@pytest.mark.slow
def test_diloco_run_stop_and_resume_equals_a_straight_run(tmp_path):
    n = 4  # H=3: the cut falls mid-round

    def run(*args, name):
        out = tmp_path / f"{name}.json"
        assert cli.main(["run", *args, "--run-dir", str(tmp_path / name), "--json", str(out)]) == 0
        return json.loads(out.read_text())

    reference: dict = {}  # the straight run goes alongside the stopped one: most of a run's wall time is waiting

    def straight_run():
        try:
            cfg = config_parse.from_args(cli.build_parser().parse_args(["run", *SMALL, "--steps", str(2 * n)]))
            reference.update(launcher.run(cfg, run_dir=str(tmp_path / "straight"), progress=False, timeout_s=240))
        except BaseException as e:  # surfaced below
            reference["error"] = e

    thread = threading.Thread(target=straight_run)
    thread.start()
    stopped = run(*SMALL, "--steps", str(2 * n), "--stop-after", str(n), "--checkpoint-every", str(n), name="stopped")
    root = tmp_path / "stopped" / "checkpoints"
    assert stopped["stopped_at_step"] == n and stopped["inner_steps"] == n
    assert job_checkpoint.complete_steps(root) == [n]
    resumed = run("--resume", str(root), "--no-progress", name="resumed")
    thread.join(240)
    straight = reference
    assert "error" not in straight and straight.get("inner_steps") == 2 * n, straight.get("error")
    assert resumed["resumed_from"] == str((root / f"step-{n:06d}").resolve()) and resumed["inner_steps"] == 2 * n
    assert {int(g): h for g, h in resumed["param_hash_per_group"].items()} == straight["param_hash_per_group"]
    assert resumed["params_identical"]
    assert resumed["eval_loss"] == straight["eval_loss"]
    assert resumed["initial_eval_loss"] == straight["initial_eval_loss"]
    assert resumed["periods"] == straight["periods"] and resumed["outer_rounds"] == straight["outer_rounds"]
    assert stopped["periods"] == straight["periods"][:stopped["outer_rounds"]]  # the rounds it did, no more


def test_an_auto_jobs_checkpoint_holds_the_setting_it_runs_at_that_step(tmp_path):
    """--codec auto: the codec and H may have followed the link since the start; the checkpoint's
    config is the setting running at its step (what its engine state, residuals included, belongs
    to), so a resume continues with it."""
    from types import SimpleNamespace

    from diloco.job import auto_choice

    table = auto_choice.load_table()
    now = next(e for e in table.entries if e.row == "m2-h300-int2-outer")
    cfg = job_config(groups=1, checkpoint_every=4, checkpoint_dir=str(tmp_path))  # chosen at start: fp32 H=30
    model, inner, engine = single(cfg)
    link = FakeLink()
    link.auto_schedule = SimpleNamespace(choice=SimpleNamespace(setting=now))
    keeper = job_checkpoint.JobCheckpointer(CheckpointOptions.of(cfg),
                                            group=0, rank=0, group_size=1, engine=engine, model=model,
                                            inner=inner, task=None, link=link)
    engine.inner_step = 4
    keeper.after_step(4, loss_ema=None)
    saved = job_checkpoint.load_rank(job_checkpoint.step_path(tmp_path, 4), auto_choice.apply_choice(cfg, now), 0, 0)
    assert (saved.state["config"]["transport"]["codec"], saved.state["config"]["sync"]["h"]) == ("int2", 300)
    with pytest.raises(CheckpointError, match="--codec"):  # the start's setting no longer matches it
        job_checkpoint.load_rank(job_checkpoint.step_path(tmp_path, 4), cfg, 0, 0)
