"""Every group lost at once (issue 32, point 2): a real `diloco run` whose groups are all SIGKILLed
together. The supervisor restarts them, but no group holds the job's state: the coordinator says
"job lost" at once and `diloco run` exits 75 naming where to resume, instead of waiting for
healers that can never heal."""

import time

import pytest

from diloco.job.config import Config
from diloco.runtime.launch import launcher
from diloco.runtime.launch.chaos import ChaosPlan
from diloco.runtime.ops import exit_codes
from diloco.runtime.ops.processes import processes_mentioning

pytestmark = pytest.mark.slow
HEARTBEAT_S = 2.0


class KillEveryGroup:
    """A drill that SIGKILLs every group at once, a fifth into the job, and leaves restarting them
    to the supervisor (as after a power loss or a lost network)."""

    def __init__(self, groups: int) -> None:
        self.groups, self.kills_done, self.down = groups, 0, set()
        self.killed_at: float | None = None

    def tick(self, now: float, *, live: set[int], running: set[int], progress: float) -> ChaosPlan:
        if self.killed_at is None and progress >= 0.2 and len(live) == self.groups == len(running):
            self.killed_at, self.kills_done = time.monotonic(), self.groups
            return ChaosPlan(kill=list(range(self.groups)))
        return ChaosPlan()

    def replaced(self, group: int) -> None:  # the supervisor started it from a spare: nothing to undo
        pass


def test_every_group_killed_at_once_ends_diloco_run_with_job_lost_and_exit_75(tmp_path):
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 32, 2, 32
    cfg.data.batch_size, cfg.data.eval_batches = 8, 4
    cfg.train.steps, cfg.train.log_every = 3000, 10
    cfg.sync.h = 10
    cfg.topology.groups, cfg.topology.ranks_per_group = 2, 1
    cfg.transport.timeout_s, cfg.transport.probe_bytes = 5.0, 0
    cfg.fault.heartbeat_timeout = HEARTBEAT_S
    cfg.validate()
    drill = KillEveryGroup(2)
    run_dir = tmp_path / "run"
    with pytest.raises(launcher.LaunchError) as info:
        launcher.run(cfg, run_dir=str(run_dir), progress=False, timeout_s=240, chaos=drill)
    ended = time.monotonic()
    assert drill.killed_at is not None
    assert info.value.code == exit_codes.RESTART
    message = str(info.value)  # the run's own words, not a restarted group's log tail
    assert message.startswith("job lost: every group failed; resume from checkpoint")
    assert "no complete job checkpoint under" in message or "resume: diloco run --resume" in message
    assert str(run_dir / "checkpoints") in message and "exit 75 (restart me)" in message
    # at once: the heartbeat timeout (or the restarted groups' joins) plus scheduling, not a deadline
    assert ended - drill.killed_at < HEARTBEAT_S + 15, ended - drill.killed_at
    assert processes_mentioning(str(run_dir)) == []
