"""Job checkpoint files: what a checkpoint writes, how a resume finds, verifies and refuses one (corrupt,
incomplete, another job's, settings that change the math), and pruning."""

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from job_checkpoint_helpers import G, job_config, single

from diloco import cli
from diloco.coordinator.membership import Membership
from diloco.job.config import ConfigError
from diloco.runtime.checkpoints import job_checkpoint, rank_state
from diloco.runtime.checkpoints.checkpoint import CheckpointError
from diloco.runtime.launch import launcher


def write_step(root, step, groups=G, cfg=None):
    cfg = cfg or job_config(groups=groups)
    model, inner, engine = single(cfg)
    engine.inner_step = step
    for g in range(groups):
        state = rank_state.capture(step=step, cfg=cfg, engine=engine, model=model, inner=inner, group=g)
        job_checkpoint.write_rank(root, step, g, 0, state)
        job_checkpoint.write_manifest(root, step, g, 1, cfg, mode="blocking")
    return model, inner, engine


def _corrupt(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_resume_joins_with_the_newest_step_whose_file_is_intact(tmp_path):
    """What a worker resuming from a folder of steps joins the job with: a corrupt newer file is
    skipped (the group then joins behind and heals) rather than failing it once the job started."""
    from diloco.runtime.rank import worker

    for step in (20, 40):
        write_step(tmp_path, step)
    _corrupt(tmp_path / "step-000040" / "group-0-rank-0.pt")
    point, skipped = worker._resume_point(tmp_path, 0, 0)
    assert point.step == 20 and len(skipped) == 1 and "step-000040/group-0-rank-0.pt: contents do not match" in skipped[0]
    assert worker._resume_point(tmp_path, 1, 0)[0].step == 40  # group 1's files are intact
    named = worker._resume_point(tmp_path / "step-000040", 0, 0)  # a named step is what was asked for
    assert named[0].step == 40 and named[1] == []
    _corrupt(tmp_path / "step-000020" / "group-0-rank-0.pt")
    point, skipped = worker._resume_point(tmp_path, 0, 0)
    assert point is None and len(skipped) == 2
    cfg = job_config()
    fresh = Membership(epoch=1, members={0: ("a:1",), 1: ("b:1",)}, ring=(0, 1))  # no group resumes
    with pytest.raises(CheckpointError, match="cannot be read \\(a fresh start would lose the job's training\\)"):
        worker._resume_or_heal(None, fresh, cfg, 0, 0, skipped)
    behind = dataclasses.replace(fresh, heal=True, resume_step=40)  # another group resumes: this one heals
    assert worker._resume_or_heal(None, behind, cfg, 0, 0, skipped) is None
    ahead = dataclasses.replace(fresh, resume_step=20)  # a coordinator that planned another step than its own
    with pytest.raises(ConfigError, match="started the job from checkpoint step 20, but this group resumes from step 40"):
        worker._resume_or_heal(job_checkpoint.find(tmp_path, group=1), ahead, cfg, 1, 0)


def test_a_resume_from_a_folder_of_steps_checksums_its_file_once(tmp_path, monkeypatch):
    """The file picked before joining (its checksum read to skip a corrupt one) is not read for its
    checksum again when loaded, unless it was written since; a named step folder, not checked before
    joining, is checked on load."""
    from diloco.runtime.checkpoints import checkpoint
    from diloco.runtime.rank import worker

    write_step(tmp_path, 20)
    digested = []
    real = checkpoint._digest
    monkeypatch.setattr(checkpoint, "_digest", lambda path: digested.append(path.name) or real(path))
    resuming = Membership(epoch=1, members={0: ("a:1",), 1: ("b:1",)}, ring=(0, 1), resume_step=20)
    point, _ = worker._resume_point(tmp_path, 0, 0)
    assert worker._resume_or_heal(point, resuming, job_config(), 0, 0).step == 20
    assert digested == ["group-0-rank-0.pt"]
    digested.clear()
    named, _ = worker._resume_point(tmp_path / "step-000020", 0, 0)
    assert worker._resume_or_heal(named, resuming, job_config(), 0, 0).step == 20
    assert digested == ["group-0-rank-0.pt"]
    _corrupt(tmp_path / "step-000020" / "group-0-rank-0.pt")  # altered after it was named: refused on load
    with pytest.raises(CheckpointError, match="contents do not match"):
        worker._resume_or_heal(named, resuming, job_config(), 0, 0)
    write_step(tmp_path, 40)
    point, _ = worker._resume_point(tmp_path, 0, 0)
    path = tmp_path / "step-000040" / "group-0-rank-0.pt"
    path.write_bytes(path.read_bytes()[:-1])  # truncated while the rank waited to join: checked again, refused
    with pytest.raises(CheckpointError, match="contents do not match"):
        worker._resume_or_heal(point, dataclasses.replace(resuming, resume_step=40), job_config(), 0, 0)


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
