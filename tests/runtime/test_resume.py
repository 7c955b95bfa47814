"""Resume: N + N steps == 2N steps bit for bit (in-process groups, and a real `diloco run --stop-after` /
`--resume`); the checkpointer's decisions (when to write, when to stop), the data position a resume
continues from, and the step every group must agree on. The files themselves:
test_job_checkpoint_files.py."""

import json
import os
import signal
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
from diloco_helpers import build_in_threads, run_in_threads
from job_checkpoint_helpers import G, job_config, single

from diloco import cli
from diloco.demo import data
from diloco.demo.model import GPT, GPTConfig
from diloco.engine.averaging import InProcessGroups, SingleGroup
from diloco.engine.diloco import DiLoCo
from diloco.job import config_parse
from diloco.job.config import ConfigError
from diloco.job.task import Task, TaskError
from diloco.runtime.checkpoints import job_checkpoint, rank_state
from diloco.runtime.checkpoints.checkpoint import CheckpointError
from diloco.runtime.checkpoints.job_checkpoint import CheckpointOptions
from diloco.runtime.launch import launcher
from diloco.runtime.rank import train_loop

TOKENS = np.random.default_rng(0).integers(0, 32, 4000).astype(np.uint8)


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
