"""Sharded (FSDP2) groups for tests: real processes, one Gloo world per group, real TCP between groups.

``launch(sizes, configs)`` starts ``sum(sizes)`` processes running ``sharded_worker.py``: group g
has ``sizes[g]`` ranks in a Gloo world of its own (a FileStore under a temporary folder, 127.0.0.1),
shards the model with ``fully_shard`` and averages with a ``StripedAverager`` over ``TcpTransport``
(ephemeral ports on 127.0.0.1). Each rank writes what it saw as JSON; ``launch`` returns
``results[g][r]`` (a list with one entry per config) and kills every process it started if they
do not finish in time.

``reference(config)`` runs the same config unsharded, as two groups in threads of this process
(``InProcessGroups``): with two groups and fp32 the ring's mean ``(a + b) / 2`` is the same bits
as the in-process one, so a sharded run must give the same global hash after every commit.

The synthetic inner step (``config["inner"] == "synthetic"``) adds to every parameter a
perturbation drawn from the parameter's name, the group and the step, over the whole parameter;
a sharded rank adds its rows of it. The real one (``"adamw"``) trains with backward passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
SECRET = b"sharded-test-secret-0123456789ab"


def make_model(seed: int = 0, kind: str = "small") -> nn.Module:
    """``small``: row counts that split unevenly over 2, 3 and 4 ranks; ``wide``: 395k parameters
    (what a byte count is measured on: framing is then negligible)."""
    torch.manual_seed(seed)
    if kind == "wide":
        return nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 768), nn.Tanh(), nn.Linear(768, 5))
    return nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5))


def perturbation(name: str, shape: tuple[int, ...], group: int, step: int) -> torch.Tensor:
    """The synthetic inner step's change of a whole parameter (deterministic)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{group}/{step}".encode()))
    return torch.randn(shape, generator=gen) * 0.01


def batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch for the real inner step (the same on every rank of a group)."""
    gen = torch.Generator().manual_seed(1000 * group + step)
    x = torch.randn(16, 8, generator=gen)
    return x, torch.sin(x[:, :5] * 2.0)


def outer_optimizer(config: dict[str, Any]):
    """The outer optimizer of a config; co2 with exactly rounded norms (what a sharded engine
    gives it), so that an unsharded reference computes the same outer step."""
    from diloco.engine.outer import by_mode

    factory = by_mode(config["mode"])
    if config["mode"] != "co2":
        return factory

    def make(params):
        from diloco.engine.shard_reduce import exact_sum_of_squares

        opt = factory(params)
        opt.sum_squares = exact_sum_of_squares
        return opt

    return make


def engine_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``DiLoCo`` arguments of a config."""
    out = dict(mode=config["mode"], sync_every=config.get("h", 4), fragments=config.get("fragments"),
               outer_optimizer=outer_optimizer(config), initial_sync=config.get("initial_sync", "check"))
    if config["mode"] == "overlap":
        out["overlap_steps"] = 1
    return out


def run_synthetic(engine, model: nn.Module, group: int, steps: int, shard: tuple[int, int] | None = None,
                  start: int = 0) -> list[list]:
    """Synthetic inner steps ``start`` .. ``steps - 1``; the global hash after every step that
    committed. ``shard``: (group size, rank) of a sharded model, whose rank adds its rows of each change."""
    hashes = []
    for t in range(start, steps):
        with torch.no_grad():
            for name, p in model.named_parameters():
                full = perturbation(name, tuple(p.shape), group, t)
                if shard is None:
                    p.add_(full)
                else:
                    size, rank = shard
                    n = p.shape[0]
                    per = -(-n // size)
                    p.to_local().add_(full[min(rank * per, n):min((rank + 1) * per, n)])
        events = engine.step()
        if any(e.kind == "commit" for e in events):
            hashes.append([t, engine.global_hash()])
    return hashes


def reference(config: dict[str, Any], groups: int = 2) -> list[list[list]]:
    """Per-commit global hashes of ``config`` unsharded, ``groups`` groups in threads: one list
    per group (they differ between groups only in eager mode, until the end)."""
    from diloco_helpers import build_in_threads, run_in_threads

    from diloco.engine.averaging import InProcessGroups
    from diloco.engine.diloco import DiLoCo

    models = [make_model(kind=config.get("model", "small")) for _ in range(groups)]
    pool = InProcessGroups(groups)
    engines = build_in_threads(lambda g: DiLoCo(models[g], torch.optim.SGD(models[g].parameters(), lr=0.1),
                                                averager=pool.member(g), **engine_kwargs(config)), groups)
    out: list[list] = [[] for _ in range(groups)]

    def work(g: int) -> None:
        out[g] = run_synthetic(engines[g], models[g], g, config["steps"])
        engines[g].close()
        out[g].append(["final", engines[g].global_hash()])

    run_in_threads(work, groups)
    return out


class Ranks:
    """Processes of sharded test ranks (``sharded_worker.py``), killed if still running at exit."""

    def __init__(self, tmp: Path, sizes: list[int], configs: list[dict[str, Any]]) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        for stale in tmp.glob("*.store"):  # a FileStore left by an earlier launch would be read as this one's
            stale.unlink()
        self.tmp, self.sizes, self.configs = tmp, sizes, configs
        self.procs: list[tuple[int, int, int, Any, subprocess.Popen]] = []

    def start(self, group: int, incarnation: int = 0) -> None:
        """Start every rank of ``group`` (a restarted group: a new ``incarnation``, a new Gloo world)."""
        spec = self.tmp / f"spec-{group}-{incarnation}.json"
        spec.write_text(json.dumps({"sizes": self.sizes, "configs": self.configs, "dir": str(self.tmp),
                                    "incarnation": incarnation}))
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        for r in range(self.sizes[group]):
            log = open(self.tmp / f"log-{group}-{r}-{incarnation}.txt", "w")
            self.procs.append((group, r, incarnation, log, subprocess.Popen(
                [sys.executable, str(HERE / "sharded_worker.py"), str(spec), str(group), str(r)],
                env=env, stdout=log, stderr=subprocess.STDOUT)))

    def wait(self, group: int | None, incarnation: int, deadline: float, expect_rc: int = 0) -> None:
        """Wait for the ranks of ``group`` (None: all) of ``incarnation`` to exit with ``expect_rc``."""
        for g, r, inc, _, p in self.procs:
            if inc != incarnation or group is not None and g != group:
                continue
            log = self.tmp / f"log-{g}-{r}-{inc}.txt"
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"group {g} rank {r} did not finish in time:\n" + log.read_text()[-3000:]) from None
            if p.returncode != expect_rc:
                raise AssertionError(f"group {g} rank {r} exited {p.returncode}, not {expect_rc}:\n"
                                     + log.read_text()[-4000:])

    def results(self, incarnations: dict[int, int] | None = None) -> list[list[list]]:
        """``results[g][r][k]``: what rank r of group g reported for config k (its last incarnation)."""
        inc = incarnations or {}
        return [[json.loads((self.tmp / f"out-{g}-{r}-{inc.get(g, 0)}.json").read_text()) for r in range(size)]
                for g, size in enumerate(self.sizes)]

    def close(self) -> None:
        for _, _, _, log, p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            log.close()


def launch(sizes: list[int], configs: list[dict[str, Any]], tmp: Path, timeout_s: float = 150.0) -> list[list[list]]:
    """Run ``configs`` (in order, fresh transports each) on sharded groups of ``sizes`` ranks;
    ``results[g][r][k]`` is what rank r of group g reported for config k."""
    ranks = Ranks(tmp, sizes, configs)
    try:
        for g in range(len(sizes)):
            ranks.start(g)
        ranks.wait(None, 0, time.monotonic() + timeout_s)
        return ranks.results()
    finally:
        ranks.close()
