"""A job restarted from checkpoints whose groups keep them on their own volumes, one group behind
(real coordinator and torchrun groups on 127.0.0.1, ``diloco worker --resume auto`` as the
Kubernetes manifests run it): the group at the newest step resumes from it, the group behind it
(it missed the last checkpoint, or its volume is new and empty) heals from it instead of refusing
the resume, and the job ends with every group at the last step and identical parameters."""

import shutil

import pytest
from diloco_helpers import write_small_job
from process_job import Job

from diloco import cli
from diloco.runtime.checkpoints import job_checkpoint

pytestmark = pytest.mark.slow
STEPS, EVERY, STOP = 80, 20, 40


def own_volumes(shared, tmp_path) -> dict[int, object]:
    """Each group's checkpoint folder as its own volume would hold it: its files of every step."""
    dirs = {}
    for g in (0, 1):
        dirs[g] = tmp_path / f"volume-{g}"
        for step in job_checkpoint.complete_steps(shared):
            src, dst = job_checkpoint.step_path(shared, step), job_checkpoint.step_path(dirs[g], step)
            dst.mkdir(parents=True)
            for f in src.iterdir():
                if f.name.startswith((f"group-{g}-", f"group-{g}.")):
                    shutil.copy2(f, dst / f.name)
    return dirs


@pytest.mark.parametrize("behind", ["missed the last checkpoint", "new empty volume"])
def test_the_group_behind_heals_from_the_newest_step(tmp_path, behind):
    path = tmp_path / "config.json"
    write_small_job(path, steps=STEPS, ranks_per_group=1)
    first = tmp_path / "first"
    assert cli.main(["run", "--config", str(path), "--stop-after", str(STOP), "--checkpoint-every", str(EVERY),
                     "--run-dir", str(first), "--no-progress"]) == 0
    volumes = own_volumes(first / "checkpoints", tmp_path)
    assert job_checkpoint.complete_steps(volumes[1], group=1) == [EVERY, STOP]
    if behind == "missed the last checkpoint":
        shutil.rmtree(job_checkpoint.step_path(volumes[0], STOP))
        assert job_checkpoint.complete_steps(volumes[0], group=0) == [EVERY]
    else:
        shutil.rmtree(volumes[0])

    job = Job(tmp_path, path)
    try:
        workers = [job.start_group(g, 1, "--resume", "auto", "--checkpoint-dir", str(volumes[g]),
                                   "--checkpoint-every", str(EVERY)) for g in (0, 1)]
        codes = [w.wait(timeout=240) for w in workers]
        out = job.coordinator.communicate(timeout=60)[0].decode()
    finally:
        job.close()
    logs = [job.log(g, 1).read_text(errors="replace") for g in (0, 1)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    was = "step 20" if behind == "missed the last checkpoint" else "none"
    assert f"group 0 heals from the groups at step {STOP} instead of resuming from {was}" in logs[0], logs[0][-3000:]
    assert "healed from group 1" in logs[0]
    assert f"at step {STOP}" in logs[1] and "resumed from" in logs[1] and "heals from" not in logs[1]
    assert job.coordinator.returncode == 0, out[-3000:]
    assert "global params identical  : True" in out and f"inner steps per rank     : {STEPS}" in out
    # both groups checkpoint together again after it (none is written after the last step)
    assert job_checkpoint.complete_steps(volumes[0], group=0)[-1] == 60
    assert job_checkpoint.complete_steps(volumes[1], group=1)[-1] == 60


def test_under_auto_flags_the_group_behind_heals_on_the_jobs_setting(tmp_path):
    """--codec/--h auto: a healer learns the job's setting from the job's latest quorum, so the group
    behind cannot heal before the job's first exchange: it exits 75 ("restart me") until then, as
    any healer does, and its restart (its pod's) heals on the checkpoint's setting."""
    steps = 8000  # the group ahead trains for ~25 s: still training when group 0 restarts (~5 s)
    path = tmp_path / "config.json"
    write_small_job(path, steps=steps, ranks_per_group=1)
    auto = ["--codec", "topk", "--h", "auto", "--probe-bytes", "4096"]
    first = tmp_path / "first"
    assert cli.main(["run", "--config", str(path), *auto, "--stop-after", str(STOP), "--checkpoint-every",
                     str(EVERY), "--run-dir", str(first), "--no-progress"]) == 0
    volumes = own_volumes(first / "checkpoints", tmp_path)
    shutil.rmtree(job_checkpoint.step_path(volumes[0], STOP))

    job = Job(tmp_path, path)
    try:
        flags = lambda g: ["--resume", "auto", "--checkpoint-dir", str(volumes[g]), *auto]  # noqa: E731
        ahead = job.start_group(1, 1, *flags(1))
        attempt, codes = 1, []
        while True:  # group 0's supervisor: a pod restarted after "exit 75 (restart me)"
            codes.append(job.start_group(0, attempt, *flags(0)).wait(timeout=240))
            if "exit 75 (restart me)" not in job.log(0, attempt).read_text(errors="replace") or attempt == 4:
                break
            attempt += 1
        assert ahead.wait(timeout=240) == 0, job.log(1, 1).read_text()[-3000:]
        out = job.coordinator.communicate(timeout=60)[0].decode()
    finally:
        job.close()
    healed = job.log(0, attempt).read_text(errors="replace")
    assert codes[-1] == 0 and 1 < attempt < 4, healed[-3000:]
    assert "cannot learn it to heal; restart it to heal once it has" in job.log(0, 1).read_text(errors="replace")
    assert "healed from group 1" in healed and "(the setting of the job's latest quorum)" in healed
    assert job.coordinator.returncode == 0, out[-3000:]
    assert "global params identical  : True" in out and f"inner steps per rank     : {steps}" in out
