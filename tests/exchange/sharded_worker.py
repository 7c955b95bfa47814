"""One rank of a sharded test group (started by ``sharded_helpers.launch``; not a test itself).

Arguments: the spec file, the group, the rank. For every config of the spec: a fresh
``TcpTransport`` (addresses shared through a FileStore), the test model sharded with
``fully_shard`` over this group's Gloo world, a ``StripedAverager``, ``DiLoCo``, the inner steps;
the per-commit global hashes, bytes sent and checks go to ``out-<group>-<rank>.json``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sharded_helpers import SECRET, batch, engine_kwargs, make_model, run_synthetic  # noqa: I001

import compress
from diloco.engine.averaging import InProcessGroups, SingleGroup
from diloco.engine.diloco import DiLoCo
from diloco.engine.shard_layout import ShardingError
from diloco.exchange.striped import StripedAverager
from transport import TcpTransport


class Membership:
    """Every group's rank addresses, in the shape the averager reads."""

    def __init__(self, addresses: list[list[str]]) -> None:
        self.groups = list(range(len(addresses)))
        self.ring_order = list(self.groups)
        self._addresses = addresses

    def ranks(self, group: int) -> list[str]:
        return self._addresses[group]


def shard(model: torch.nn.Module, size: int) -> torch.nn.Module:
    """``fully_shard`` every Linear, then the root, over this group's world."""
    mesh = init_device_mesh("cpu", (size,))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def refusals() -> dict:
    """What the engine says to a model it cannot exchange per shard (one message per case)."""
    out = {}
    part = make_model()
    fully_shard(part[0], mesh=init_device_mesh("cpu", (dist.get_world_size(),)))  # the root is left whole
    try:
        DiLoCo(part, torch.optim.SGD(part.parameters(), lr=0.1), averager=SingleGroup())
    except ShardingError as e:
        out["partly_sharded"] = str(e)
    whole = shard(make_model(), dist.get_world_size())
    try:
        DiLoCo(whole, torch.optim.SGD(whole.parameters(), lr=0.1), averager=InProcessGroups(1).member(0))
    except ValueError as e:
        out["averager"] = str(e)
    engine = DiLoCo(whole, torch.optim.SGD(whole.parameters(), lr=0.1), averager=SingleGroup())
    out["single_group_hash"] = engine.global_hash()
    out["local_numel"], out["numel"] = engine.local_numel, engine.numel
    return out


def connect(key: str, group: int, rank: int, sizes: list[int], store) -> tuple[TcpTransport, Membership]:
    """A fresh transport and every rank's address, shared under ``key`` in the job's store."""
    transport = TcpTransport(secret=SECRET, timeout_s=30)
    store.set(f"{key}/addr/{group}/{rank}", transport.address)
    return transport, Membership([[store.get(f"{key}/addr/{g}/{r}").decode() for r in range(n)]
                                  for g, n in enumerate(sizes)])


def resumed(k: int, config: dict, group: int, rank: int, sizes: list[int], store) -> dict:
    """Synthetic steps to ``stop``, a DCP checkpoint of the group, and a fresh engine that loads it
    and runs to ``steps`` (``load_from``: only the second part, from another launch's checkpoint)."""
    from diloco.runtime.checkpoints import dcp_checkpoint

    codec = compress.get_codec(config["codec"]) if config.get("codec") else None
    size = sizes[group]

    def build(phase: str):
        transport, members = connect(f"c{k}/{phase}", group, rank, sizes, store)
        model = shard(make_model(), size)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        avg = StripedAverager(transport, members, group=group, rank=rank, codec=codec, timeout_s=30)
        return transport, model, inner, DiLoCo(model, inner, averager=avg, **engine_kwargs(config))

    out: dict = {}
    saved_to = Path(config["load_from"] if "load_from" in config else config["dir"]) / f"group-{group}"
    if "load_from" not in config:
        for phase, stop in (("full", config["steps"]), ("part", config["stop"])):
            transport, model, inner, engine = build(phase)
            out[phase] = run_synthetic(engine, model, group, stop, shard=(size, rank))
            if phase == "full":
                engine.close()
                out[phase].append(["final", engine.global_hash()])
            else:
                out["saved_hash"] = engine.global_hash()
                dcp_checkpoint.save(saved_to, engine, model, inner, extra={"step": stop})
                engine.abandon()
            transport.close()
    transport, model, inner, engine = build("resumed")
    extra = dcp_checkpoint.load(saved_to, engine, model, inner)
    out["loaded_hash"] = engine.global_hash()
    out["resumed"] = run_synthetic(engine, model, group, config["steps"], shard=(size, rank), start=extra["step"])
    engine.close()
    out["resumed"].append(["final", engine.global_hash()])
    transport.close()
    return out


def connected(config: dict, group: int, rank: int, sizes: list[int], folder: Path) -> dict:
    """A group in a job with a coordinator (``diloco.connect``: quorums, votes, healing). The
    group ``die_group`` exits at step ``die_at`` (os._exit: no goodbye) in its first incarnation;
    group 0 waits at step ``die_at + 4`` until every rank of the restarted group is about to heal."""
    import os

    import diloco
    from diloco.job.config import TransportConfig

    settings = TransportConfig(host="127.0.0.1", timeout_s=5.0, probe_bytes=0)
    link = diloco.connect(config["coordinator"], group, secret=SECRET, settings=settings, heartbeat_timeout=2.0)
    restarted = config["incarnation"] > 0
    model = shard(make_model(), sizes[group])
    if restarted:  # about to build the engine, which asks to heal at once
        (folder / f"connected-{group}-{rank}").write_text("")
    engine = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), averager=link, **engine_kwargs(config))
    out: dict = {"start": engine.inner_step, "hashes": []}
    for t in range(engine.inner_step, config["steps"]):
        if group == config["die_group"] and t == config["die_at"] and not restarted:
            # mid-step: the exchange this step launches is under way (or about to be) when it dies
            threading.Timer(config.get("die_delay_s", 0.0), os._exit, args=(17,)).start()
        if group != config["die_group"] and t == config["die_at"] + 4:
            while not all((folder / f"connected-{config['die_group']}-{r}").exists()
                          for r in range(sizes[config["die_group"]])):
                time.sleep(0.05)
            time.sleep(2.0)  # its ask to heal reaches the coordinator before this group's next exchange
        out["hashes"] += [[h[0], h[1]] for h in run_synthetic(engine, model, group, t + 1, shard=(sizes[group], rank),
                                                               start=t)]
    engine.close()
    out["hashes"].append(["final", engine.global_hash()])
    out["healed"] = bool(link.fault_stats.healed)
    out["rollbacks"] = int(link.fault_stats.rollbacks)
    link.close()
    return out


def run_config(k: int, config: dict, group: int, rank: int, sizes: list[int], store) -> dict:
    if config.get("inner") == "refusals":
        return refusals()
    if "coordinator" in config:
        return connected(config, group, rank, sizes, Path(config["dir"]))
    if "stop" in config:
        return resumed(k, config, group, rank, sizes, store)
    transport, members = connect(f"c{k}", group, rank, sizes, store)
    codec = compress.get_codec(config["codec"]) if config.get("codec") else None
    model = shard(make_model(kind=config.get("model", "small")), sizes[group])
    real = config.get("inner") == "adamw"
    inner = (torch.optim.AdamW if real else torch.optim.SGD)(model.parameters(), lr=1e-2)
    avg = StripedAverager(transport, members, group=group, rank=rank, codec=codec, timeout_s=30)
    out: dict = {"merged_equals_global": []}
    try:
        engine = DiLoCo(model, inner, averager=avg, **engine_kwargs(config))
        out.update(numel=engine.numel, local_numel=engine.local_numel,
                   global_bytes=sum(g.numel() * 4 for g in engine.global_params))
        if real:
            hashes = []
            for t in range(config["steps"]):
                x, y = batch(group, t)
                torch.nn.functional.mse_loss(model(x), y).backward()
                inner.step()
                inner.zero_grad()
                events = engine.step()
                if any(e.kind == "commit" for e in events):
                    hashes.append([t, engine.global_hash()])
                    if config["mode"] == "blocking":  # the model now holds the global parameters
                        glob = engine.global_state_dict()
                        out["merged_equals_global"].append(all(
                            torch.equal(p.full_tensor(), glob[n].full_tensor()) for n, p in model.named_parameters()))
        else:
            hashes = run_synthetic(engine, model, group, config["steps"], shard=(sizes[group], rank))
        engine.close()
        hashes.append(["final", engine.global_hash()])
        out["hashes"] = hashes
        if real:
            x, y = batch(99, 0)
            with torch.no_grad():
                out["eval_loss"] = float(torch.nn.functional.mse_loss(model(x), y))
    finally:
        transport.close()
    out["bytes_sent"] = int(transport.bytes_sent)
    return out


def main() -> None:
    spec_path, group, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(Path(spec_path).read_text())
    sizes, folder = spec["sizes"], Path(spec["dir"])
    incarnation = spec.get("incarnation", 0)
    for config in spec["configs"]:
        config.setdefault("incarnation", incarnation)
    store = folder / f"group-{group}-{incarnation}.store"
    dist.init_process_group("gloo", store=dist.FileStore(str(store), sizes[group]), rank=rank, world_size=sizes[group])
    job = dist.FileStore(str(folder / "job.store"), sum(sizes))
    started = time.perf_counter()
    results = [run_config(k, c, group, rank, sizes, job) for k, c in enumerate(spec["configs"])]
    results.append({"seconds": time.perf_counter() - started})
    (folder / f"out-{group}-{rank}-{incarnation}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
