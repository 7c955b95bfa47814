"""Every Python snippet of the README runs as written.

Each snippet names what the reader brings (``# yours: ...``); the test brings exactly that, on
127.0.0.1, and executes the snippet's text unchanged. A snippet no runner here recognizes fails
the test, so a new snippet cannot go untested.
"""

from __future__ import annotations

import importlib
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from diloco_helpers import free_port_range

import diloco
from diloco.coordinator import CoordinatorServer

ROOT = Path(__file__).resolve().parents[1]
SECRET = "ab" * 32


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def run_regression_entry(code: str) -> None:
    """The abridged entry point, in the namespace of the module it abridges: builds the same task."""
    module = importlib.import_module("examples.regression")
    namespace = dict(vars(module))
    exec(compile(code, "README.md", "exec"), namespace)
    ctx = diloco.TaskContext(group=1, num_groups=2, rank=0, group_size=1, device=torch.device("cpu"), seed=3,
                             steps=5, batch_size=8, data_path="")
    ours, theirs = namespace["make_task"](ctx), module.make_task(ctx)
    assert isinstance(ours, diloco.Task)
    for a, b in zip(ours.model.state_dict().values(), theirs.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(next(ours.train_batches), next(theirs.train_batches)))
    assert len(ours.eval_batches) == 4


def run_training_loop(code: str, monkeypatch) -> None:
    """connect + DiLoCo around a user's loop: one group of one rank, a real coordinator."""
    monkeypatch.setenv("DILOCO_SECRET", SECRET)
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    server = CoordinatorServer(host="127.0.0.1", port=0, expected_groups=1)
    address = server.start()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())][:-1])  # 4 equal layers
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(1100, 8)
        loader = [(x[i:i + 1], x[i:i + 1].flip(-1)) for i in range(1100)]
        namespace = {"model": model, "opt": opt, "loader": loader, "loss_fn": nn.functional.mse_loss,
                     "coordinator": address}
        exec(compile(code, "README.md", "exec"), namespace)
        snapshot = server.snapshot()
    finally:
        server.stop()
    assert snapshot["rounds_state"]["committed"] >= 4, "the snippet's loop synced no fragment"
    assert 0 in snapshot["progress"], "the snippet's report_progress did not reach the coordinator"


def run_data_plane(code: str) -> None:
    """The data plane alone: two members run the snippet, each with its own x; both get the mean."""
    base = free_port_range(2)
    ports = [base, base + 1]
    ring = [f"127.0.0.1:{p}" for p in ports]
    xs = [torch.full((5000,), float(i + 1)) for i in range(2)]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def member(index: int) -> None:
        namespace = {"host": "127.0.0.1", "port": ports[index], "secret": bytes.fromhex(SECRET), "tls": None,
                     "x": xs[index], "ring": ring, "index": index}
        try:
            exec(compile(code, "README.md", "exec"), namespace)
            results[index] = namespace["mean"]
        except BaseException as e:  # noqa: BLE001 - re-raised by the test below
            errors.append(e)
        finally:
            if "t" in namespace:
                namespace["t"].close()

    threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert torch.equal(results[0], results[1])
    assert torch.allclose(results[0], torch.full((5000,), 1.5), rtol=0.01)


RUNNERS = {"def make_task": run_regression_entry, "diloco.connect(": run_training_loop,
           "TcpTransport(": run_data_plane}


def test_every_snippet_has_a_runner():
    snippets = python_snippets()
    assert len(snippets) >= 3
    for code in snippets:
        assert sum(key in code for key in RUNNERS) == 1, f"no runner (or several) for the README snippet:\n{code}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key", sorted(RUNNERS))
def test_the_readme_snippet_runs_as_written(key, monkeypatch):
    code = next(c for c in python_snippets() if key in c)
    runner = RUNNERS[key]
    if runner is run_training_loop:
        runner(code, monkeypatch)
    else:
        runner(code)
