"""A job restarted from checkpoints whose groups keep them on their own volumes, one group behind
(real coordinator and torchrun groups on 127.0.0.1, ``diloco worker --resume auto`` as the
Kubernetes manifests run it): the group at the newest step resumes from it, and the group behind
it (it missed the last checkpoint, its volume is new and empty, it was started without --resume,
a corrupt file) heals from it, its checkpoint not loaded, also under --codec/--h auto
(every case under --min-groups 2, which makes the heal's round deterministic); the job ends with every group at the last step and identical parameters. A
named step folder that is not every group's stops the job before it starts (exit 2)."""

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


def stopped_job(tmp_path, *flags: str):
    """A job of STEPS steps (``flags`` added) stopped at STOP with checkpoints every EVERY steps:
    (its config file, each group's checkpoint folder as its own volume holds it)."""
    path = tmp_path / "config.json"
    write_small_job(path, steps=STEPS, ranks_per_group=1)
    first = tmp_path / "first"
    assert cli.main(["run", "--config", str(path), *flags, "--stop-after", str(STOP), "--checkpoint-every",
                     str(EVERY), "--run-dir", str(first), "--no-progress"]) == 0
    return path, own_volumes(first / "checkpoints", tmp_path)


CASES = {  # what happened to group 0's checkpoints, how each group is started, the step group 0 joins with
    "missed the last checkpoint": dict(drop=[STOP], flags=["--resume", "auto"], joins_with=EVERY),
    "new empty volume": dict(drop=[EVERY, STOP], flags=["--resume", "auto"], joins_with=None),
    "each group given its folder": dict(drop=[STOP], flags=["--resume", "{volume}"], joins_with=EVERY),
    "its only checkpoint is corrupt": dict(drop=[STOP], corrupt=EVERY, flags=["--resume", "auto"], joins_with=None),
    "its newest checkpoint is corrupt": dict(drop=[], corrupt=STOP, flags=["--resume", "auto"], joins_with=EVERY),
    "started without --resume": dict(drop=[], flags=["--resume", "auto"], plain=True, joins_with=None),
}
#: the group ahead waits for the healer at each training exchange, so the heal always lands in the
#: job's next round, however slowly the healer starts (the initial check, a control exchange in
#: which no healer takes part, counts the group healing in towards it)
MIN_GROUPS = ["--min-groups", "2"]


@pytest.mark.parametrize("case", list(CASES))
def test_the_group_behind_heals_from_the_newest_step(tmp_path, case):
    c = CASES[case]
    path, volumes = stopped_job(tmp_path)
    assert job_checkpoint.complete_steps(volumes[1], group=1) == [EVERY, STOP]
    for step in c["drop"]:
        shutil.rmtree(job_checkpoint.step_path(volumes[0], step))
    if "corrupt" in c:  # a flipped byte: loading it would fail the group; the step is skipped, with a warning
        f = job_checkpoint.step_path(volumes[0], c["corrupt"]) / job_checkpoint.rank_file(0, 0)
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))

    def flags(g):
        resume = [] if g == 0 and c.get("plain") else [f.format(volume=volumes[g]) for f in c["flags"]]
        return [*resume, "--checkpoint-dir", str(volumes[g]), "--checkpoint-every", str(EVERY)]

    job = Job(tmp_path, path, *MIN_GROUPS)
    codes, out, logs = job.run({g: flags(g) for g in (0, 1)}, timeout_s=240)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    said = (f"group 0 heals from the groups at step {STOP} instead of resuming from step {c['joins_with']}"
            if c["joins_with"] else f"group 0 has no checkpoint to resume from: it heals from the groups at step {STOP}")
    assert said in logs[0], logs[0][-3000:]
    assert ("skipping a checkpoint that cannot be read" in logs[0]) == ("corrupt" in c)
    assert "healed from group 1" in logs[0]
    assert f"at step {STOP}" in logs[1] and "resumed from" in logs[1] and "heals from" not in logs[1]
    assert job.coordinator.returncode == 0, out[-3000:]
    assert "global params identical  : True" in out and f"inner steps per rank     : {STEPS}" in out
    # both groups checkpoint together again after it (none is written after the last step)
    assert job_checkpoint.complete_steps(volumes[0], group=0)[-1] == 60
    assert job_checkpoint.complete_steps(volumes[1], group=1)[-1] == 60


def test_a_named_step_folder_that_is_not_every_groups_stops_the_job_before_it_starts(tmp_path):
    """--resume DIR/step-NNNNNN is what was asked for: when another group stands elsewhere, every
    group exits 2 (configuration) naming each group's step, and nothing trains."""
    path, volumes = stopped_job(tmp_path)
    job = Job(tmp_path, path)
    codes, out, logs = job.run({0: ["--resume", str(job_checkpoint.step_path(volumes[0], EVERY))],
                                1: ["--resume", "auto", "--checkpoint-dir", str(volumes[1])]}, timeout_s=120)
    for log in logs:
        assert "exit 2 (configuration error)" in log and "group(s) 0 named a checkpoint step" in log, log[-3000:]
        assert "(group 0: step 20, group 1: step 40)" in log and "committed data samples" not in log
    assert codes == [1, 1]  # torchrun's own code for a worker that failed
    assert job.coordinator.returncode == 2, out[-3000:]


def test_under_auto_flags_the_group_behind_heals_on_the_jobs_setting(tmp_path):
    """--codec/--h auto: a healer builds its engine with the setting of the job's latest quorum.
    Told to heal as the job starts, the group behind waits (a member, heartbeating, its links
    answering the others' probes) for the job's first exchange, then heals on the checkpoint's
    setting, in its first start (under --min-groups 2 too: the group ahead's initial check counts it)."""
    auto = ["--codec", "topk", "--h", "auto", "--probe-bytes", "4096"]
    path, volumes = stopped_job(tmp_path, *auto)
    shutil.rmtree(job_checkpoint.step_path(volumes[0], STOP))

    job = Job(tmp_path, path, *MIN_GROUPS)
    codes, out, logs = job.run({g: ["--resume", "auto", "--checkpoint-dir", str(volumes[g]), *auto] for g in (0, 1)},
                               timeout_s=240)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "waits for the job's first exchange to learn its --codec/--h auto setting" in logs[0]
    assert "healed from group 1" in logs[0] and "(the setting of the job's latest quorum)" in logs[0]
    assert "(the setting of checkpoint step-000040)" in logs[1]
    assert job.coordinator.returncode == 0, out[-3000:]
    assert "global params identical  : True" in out and f"inner steps per rank     : {STEPS}" in out
