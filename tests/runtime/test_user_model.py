"""A user's own model, through ``diloco run --entry`` and through ``diloco.connect`` + ``DiLoCo``."""

import json
import os
import secrets
import textwrap
from pathlib import Path

import torch
import torch.nn as nn
from diloco_helpers import run_api_example, run_in_threads

import diloco
from diloco import cli
from diloco.coordinator import CoordinatorServer
from diloco.job.config import TransportConfig

REPO = Path(__file__).resolve().parents[2]
RUN = ["run", "--no-progress", "--groups", "2", "--ranks-per-group", "1", "--timeout", "60"]

WRONG_SEEDS = textwrap.dedent("""
    import torch, torch.nn as nn, diloco

    def make_task(ctx):
        torch.manual_seed(ctx.group)  # the mistake: every group builds other initial weights
        g = torch.Generator().manual_seed(ctx.group)

        def batches():
            while True:
                x = torch.randn(8, 4, generator=g)
                yield x, x.sum(1, keepdim=True)

        return diloco.Task(model=nn.Linear(4, 1), train_batches=batches(),
                           loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
                           eval_batches=[(torch.ones(2, 4), torch.full((2, 1), 4.0))])
""")


def test_user_model_trains_through_diloco_run_entry(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # --entry modules import like `python -m`: from the current directory
    out = tmp_path / "s.json"
    code = cli.main([*RUN, "--entry", "examples.regression:make_task", "--entry-args", "width=64",
                     "--steps", "60", "--h", "20", "--inner-lr", "3e-3", "--codec", "int8",
                     "--json", str(out), "--run-dir", str(tmp_path / "run")])
    assert code == 0
    s = json.loads(out.read_text())
    assert s["entry"] == "examples.regression:make_task" and s["corpus"] is None
    assert s["outer_rounds"] == 3 and s["params_identical"]
    assert s["num_parameters"] == 16 * 64 + 64 + 64 * 64 + 64 + 64 + 1  # width=64 reached the entry
    assert s["eval_loss"] < 0.5 * s["initial_eval_loss"]
    log = (tmp_path / "run" / "group-1.log").read_text()
    assert "diloco worker group 1 rank 0: eval loss" in log  # each worker prints its summary line


def test_groups_with_different_initial_weights_are_refused_or_copied(tmp_path, monkeypatch):
    (tmp_path / "wrong_seeds.py").write_text(WRONG_SEEDS)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = [*RUN, "--entry", "wrong_seeds:make_task", "--steps", "10", "--h", "5", "--probe-bytes", "0"]
    code = cli.main([*base, "--run-dir", str(tmp_path / "refused")])
    assert code == 2  # a configuration error: restarting the groups would repeat it
    log = (tmp_path / "refused" / "group-0.log").read_text()
    assert "InitialParamsMismatch" in log and "--initial-sync copy" in log
    out = tmp_path / "copied.json"
    code = cli.main([*base, "--initial-sync", "copy", "--json", str(out), "--run-dir", str(tmp_path / "copied")])
    assert code == 0
    assert json.loads(out.read_text())["params_identical"]


def test_an_entry_that_does_not_import_is_an_error_before_any_process_starts(tmp_path, capsys):
    code = cli.main([*RUN, "--entry", "no_such_module_here:make", "--run-dir", str(tmp_path / "r")])
    assert code == 2
    assert "cannot import 'no_such_module_here'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_connect_gives_probes_plans_metrics_round_reports_and_summaries():
    secret = secrets.token_bytes(32)
    steps, h = 12, 4
    with CoordinatorServer(expected_groups=2, token="tok") as server:
        address = server.address
        summaries, metrics = {}, {}

        torch.manual_seed(0)
        models = [nn.Linear(8, 2) for _ in range(2)]
        with torch.no_grad():  # the same start in both (the global RNG is not per thread)
            models[1].load_state_dict(models[0].state_dict())

        def group(g):
            model = models[g]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(g)
            settings = TransportConfig(probe_bytes=1 << 14, timeout_s=30)
            with diloco.connect(address, g, secret=secret, codec="int8", token="tok", settings=settings) as link:
                with diloco.DiLoCo(model, opt, averager=link, sync_every=h, hook_optimizer=True) as engine:
                    for _ in range(steps):
                        x = torch.randn(16, 8, generator=gen)
                        ((model(x) - x[:, :2]) ** 2).mean().backward()
                        opt.step()
                        opt.zero_grad()
                        link.report_progress(loss=1.0)
                summaries[g] = link.summary(engine)
                metrics[g] = {m.name: s.value for m in link.metrics.registry.collect() for s in m.samples
                              if s.name.endswith("_total") or m.type == "gauge"}

        run_in_threads(group, 2, timeout_s=60)
        snap = server.snapshot()
    assert set(summaries) == {0, 1}
    assert summaries[0]["param_hash"] == summaries[1]["param_hash"]
    assert summaries[0]["round_hashes"] == summaries[1]["round_hashes"] and len(summaries[0]["round_hashes"]) == 3
    assert set(snap["summaries"]) == {0, 1}  # reported to the coordinator
    assert snap["bandwidth"] and snap["divergence"] == []  # probes reported; rounds compared, none differ
    for g in (0, 1):
        assert metrics[g]["diloco_inner_steps"] == steps
        assert metrics[g]["diloco_outer_syncs"] == steps // h
        assert metrics[g]["diloco_wire_sent_bytes"] > 0
        assert metrics[g]["diloco_sync_period_steps"] == h


def test_the_python_api_example_runs_as_two_processes():
    results, snapshot = run_api_example(REPO / "examples" / "train_api.py", ["--steps", "40", "--h", "10"])
    assert set(snapshot["summaries"]) == {0, 1}
    assert results[0]["param_hash"] == results[1]["param_hash"]
    assert results[0]["outer_rounds"] == 4 and results[0]["bytes_sent"] > 0


def test_api_glue_is_at_most_15_lines():
    text = (REPO / "examples" / "train_api.py").read_text().splitlines()
    start = next(i for i, line in enumerate(text) if "# --- diloco:" in line)
    stop = next(i for i, line in enumerate(text) if line.strip().startswith("# --- diloco ---"))
    glue = [line for line in text[start + 1 : stop] if line.strip()]
    user_loop = {"loss = mse(model, next(data))", "loss.backward()", "opt.step()", "opt.zero_grad()",
                 "for step in range(args.steps):"}
    assert len([line for line in glue if line.strip() not in user_loop]) <= 15


def test_entry_args_are_checked_before_any_process_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli.main([*RUN, "--entry-args", "width=64", "--run-dir", str(tmp_path / "a")]) == 2
    assert "--entry-args needs --entry" in capsys.readouterr().err
    assert cli.main([*RUN, "--entry", "examples.regression:make_task", "--entry-args", "width",
                     "--run-dir", str(tmp_path / "b")]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_group_that_closes_without_a_summary_is_finished_and_one_that_fails_is_not():
    """An API job that never calls link.summary() reports one at close (else the coordinator
    fails the quiet group and, once all are quiet, calls the job lost); a `with` block left on an
    error reports none."""
    secret = secrets.token_bytes(32)
    steps, h = 8, 4
    with CoordinatorServer(expected_groups=2, token="tok") as server:
        torch.manual_seed(0)
        models = [nn.Linear(8, 2) for _ in range(2)]
        with torch.no_grad():
            models[1].load_state_dict(models[0].state_dict())
        errors = {}

        def group(g):
            model = models[g]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(g)
            settings = TransportConfig(probe_bytes=1 << 14, timeout_s=30)
            try:
                with diloco.connect(server.address, g, secret=secret, token="tok", settings=settings) as link:
                    with diloco.DiLoCo(model, opt, averager=link, sync_every=h, hook_optimizer=True):
                        for _ in range(steps):
                            x = torch.randn(16, 8, generator=gen)
                            ((model(x) - x[:, :2]) ** 2).mean().backward()
                            opt.step()
                            opt.zero_grad()
                    if g == 1:
                        raise RuntimeError("the user's evaluation failed")
            except RuntimeError as e:
                errors[g] = str(e)

        run_in_threads(group, 2, timeout_s=60)
        snap = server.snapshot()
    assert errors == {1: "the user's evaluation failed"}
    assert set(snap["summaries"]) == {0}  # group 0 finished at close; group 1 failed and said nothing
    summary = snap["summaries"][0]
    assert summary["outer_rounds"] == steps // h and summary["inner_steps"] == steps
    assert len(summary["param_hash"]) == 16
