"""Warm spares (``diloco run --spares N``): a restarted group of one rank becomes a process that
already imported python, torch and the worker, and a new spare takes its place. A real job's
group restarted from a spare: ``tests/runtime/test_auto_join.py -k killed``."""

import json
from pathlib import Path

from diloco import cli
from diloco.runtime.launch import spare
from diloco.runtime.launch.supervise import Supervisor


class _Proc:
    def __init__(self, code: int | None = None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


class _Group:
    def __init__(self, group: int, proc: _Proc) -> None:
        self.group, self.proc, self.log_path = group, proc, Path(f"group-{group}.log")

    def tail(self, lines: int = 20) -> str:
        return ""


def test_a_restarted_group_takes_the_oldest_live_spare_and_a_new_one_is_started():
    spawned, spares, assigned = [], [], []

    def spawn(g: int, attempt: int) -> _Group:
        spawned.append((g, attempt))
        return _Group(g, _Proc(75 if (g, attempt) == (1, 0) else None))

    def start_spare():
        spares.append(_Proc())
        return type("S", (), {"proc": spares[-1]})()

    def assign(s, g: int, attempt: int) -> _Group:
        assigned.append((g, attempt, spares.index(s.proc)))
        return _Group(g, s.proc)

    sup = Supervisor(spawn, groups=2, max_restarts=3, spares=2, start_spare=start_spare, assign=assign)
    sup.start()
    assert spawned == [(0, 0), (1, 0)] and len(spares) == 2  # first starts are plain; two spares wait
    spares[0].code = -9  # the oldest spare died meanwhile: it is skipped
    assert sup.poll(live={0, 1}, progress=0.5) is False
    assert assigned == [(1, 1, 1)] and spawned == [(0, 0), (1, 0)]
    assert len(spares) == 4 and len(sup.ready) == 2 and sup.spares_used[0]["group"] == 1  # refilled to two
    assert {id(p.proc) for p in sup.all_procs()} >= {id(spares[2]), id(spares[3])}  # ended with the run


def test_a_group_the_drill_kills_takes_a_ready_spare_at_once_and_is_not_started_again_after_the_pause(monkeypatch):
    from diloco.runtime.launch import supervise
    from diloco.runtime.launch.chaos import ChaosMonkey

    monkeypatch.setattr(supervise, "kill_tree", lambda proc: setattr(proc, "code", -9))
    spares, assigned, told = [], [], []

    def start_spare():
        spares.append(_Proc())
        return type("S", (), {"proc": spares[-1]})()

    def run(spare_count: int, clock: list[float]) -> Supervisor:
        drill = ChaosMonkey(1, seed=0, gap_s=(0.0, 0.0), pause_s=(5.0, 5.0))
        monkeypatch.setattr(supervise.time, "monotonic", lambda: clock[0])
        sup = Supervisor(lambda g, a: _Group(g, _Proc()), groups=2, max_restarts=0, chaos=drill, spares=spare_count,
                         start_spare=start_spare, assign=lambda s, g, a: assigned.append((g, a)) or _Group(g, s.proc),
                         on_exit=lambda g, why: told.append(g))
        sup.start()
        sup.poll(live={0, 1}, progress=0.1)  # the drill's clock starts
        sup.poll(live={0, 1}, progress=0.1)  # its kill
        return sup

    clock = [100.0]
    sup = run(1, clock)
    [victim] = told
    assert assigned == [(victim, 1)] and sup.procs[victim].proc is spares[0]  # the spare took its place at once
    assert victim not in sup.chaos.down and sup.attempts[victim] == 1
    clock[0] += 10.0  # past the pause: the drill restarts nothing
    sup.poll(live={0, 1}, progress=0.2)
    assert assigned == [(victim, 1)] and sup.attempts[victim] == 1

    assigned.clear(), told.clear()
    clock = [100.0]
    sup = run(0, clock)  # no spare: the killed group waits for its host's pause
    [victim] = told
    assert victim in sup.chaos.down and sup.attempts[victim] == 0 and sup.procs[victim].proc.code == -9
    clock[0] += 10.0
    sup.poll(live={0, 1}, progress=0.2)
    assert sup.attempts[victim] == 1 and sup.procs[victim].proc.code is None


def test_an_assignment_is_checked_before_it_runs(monkeypatch, capsys):
    import io

    ran: list = []
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"argv": [1], "env": {}, "log": "x"}) + "\n"))
    assert spare.serve(ran.append) == 2 and "a spare's assignment must be" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # closed without an assignment: nothing to do
    assert spare.serve(ran.append) == 0 and not ran


def test_a_spare_imports_the_jobs_task_module_ahead_and_serves_even_when_it_cannot(tmp_path, monkeypatch, capsys):
    """What a restarted group's worker would import as it starts (seconds on a busy host) a spare
    imports before it is needed: the task's entry module among them. One it cannot import is the
    worker's to report once assigned: the spare says so and serves."""
    import io
    import sys

    from diloco.job.config import Config

    (tmp_path / "warm_probe_entry.py").write_text("def task(ctx):\n    raise AssertionError('never called')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import transport.link_spec

    links = []
    monkeypatch.setattr(transport.link_spec, "link_class", lambda name: links.append(name))
    cfg = Config()
    cfg.train.entry = "warm_probe_entry:task"
    cfg.transport.link = "grpc"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert "warm_probe_entry" not in sys.modules
    assert spare.warm(str(path)) == [] and "warm_probe_entry" in sys.modules and "torch._dynamo" in sys.modules
    assert links == ["grpc"]  # the job's link type, with the ring beneath it
    cfg.train.entry = "warm_probe_missing:task"
    path.write_text(json.dumps(cfg.to_dict()))
    (problem,) = spare.warm(str(path))
    assert "warm_probe_missing" in problem
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert spare.serve(lambda args: 1, str(path)) == 0
    assert "not warmed: TaskError" in capsys.readouterr().err and "warm_probe_missing" not in sys.modules


def test_spares_need_groups_of_one_rank(capsys):
    assert cli.main(["run", "--groups", "2", "--ranks-per-group", "2", "--spares", "1", "--steps", "10",
                     "--no-progress"]) == 2
    assert "--spares replace groups of one rank" in capsys.readouterr().err
