"""Start-up skew is not a fault (issue 46, point 2), in a real ``diloco run``: with ``--spares 1
--quorum-grace 0.5``, group 0 reaches its first training step 2 s after group 1 (a sleep in its
task, as a busy host's imports would). Before, group 1 committed the first rounds alone, group 0
was declared failed, and a kill of group 1 right after lost the whole job (exit 75, "job lost").
Now the first exchange waits for every group, a live group is never failed by the window, and the
kill leaves the job alive: it ends with identical parameters."""

from __future__ import annotations

import os
import time

import pytest

from diloco.job.config import Config
from diloco.runtime.launch import launcher
from diloco.runtime.launch.chaos import ChaosPlan

pytestmark = pytest.mark.slow
STEPS = 800

ENTRY = '''
import time

from diloco.demo import gpt_task


def task(ctx):
    """The demo task; group ``slow_group`` sleeps ``seconds`` before its first training step."""
    made = gpt_task(ctx)
    if ctx.group == int(ctx.args["slow_group"]):
        loss, slept = made.loss, []

        def late_start(net, batch):
            if net.training and not slept:
                slept.append(True)
                time.sleep(float(ctx.args["seconds"]))
            return loss(net, batch)

        made.loss = late_start
    return made
'''


class KillGroupOnce:
    """A drill that SIGKILLs one group once the job is ``at`` of the way through, and leaves its
    restart (from a spare) to the supervisor."""

    def __init__(self, group: int, at: float) -> None:
        self.group, self.at, self.kills_done = group, at, 0
        self.killed_at: float | None = None
        self.down: set[int] = set()  # groups the drill holds down itself: none, the supervisor restarts

    def tick(self, now: float, *, live: set[int], running: set[int], progress: float) -> ChaosPlan:
        if self.killed_at is None and progress >= self.at and self.group in live and self.group in running:
            self.killed_at, self.kills_done = time.monotonic(), 1
            return ChaosPlan(kill=[self.group])
        return ChaosPlan()

    def replaced(self, group: int) -> None:  # the supervisor started it from a spare: nothing to undo
        pass


def test_a_group_two_seconds_late_at_start_is_not_failed_and_a_kill_after_leaves_the_job_alive(tmp_path, monkeypatch):
    (tmp_path / "late_start_entry.py").write_text(ENTRY)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 32, 2, 32
    cfg.data.batch_size, cfg.data.eval_batches = 8, 4
    # the kill comes at 30 % (step 240) and the group is back from its spare within a round or two (CI: 1 s)
    cfg.train.steps, cfg.train.log_every = STEPS, 10
    cfg.train.entry, cfg.train.entry_args = "late_start_entry:task", "slow_group=0,seconds=2"
    cfg.sync.h = 10
    cfg.topology.groups, cfg.topology.ranks_per_group = 2, 1
    cfg.transport.timeout_s, cfg.transport.probe_bytes = 5.0, 0
    cfg.fault.heartbeat_timeout, cfg.fault.quorum_grace, cfg.fault.spares = 2.0, 0.5, 1
    cfg.validate()
    drill = KillGroupOnce(1, at=0.3)
    s = launcher.run(cfg, run_dir=str(tmp_path / "run"), progress=False, timeout_s=400, chaos=drill)
    assert drill.killed_at is not None
    assert s["params_identical"] and s["inner_steps"] == STEPS
    events = s["fault"]["events"]
    failed = [e for e in events if e["kind"] == "failure"]
    assert failed and all(e["group"] == 1 for e in failed), failed  # only the killed group, never the late one
    # the killed group came back at once from the spare (a drill's kill: no failure restart counted)
    assert s["fault"]["kills"] == 1 and s["fault"]["spares_used"] == 1 and s["fault"]["heals"] == 1
    assert all(c["twice"] == 0 and c["left_out"] == 0 for c in s["data_per_group"].values()), s["data_per_group"]
