"""One rank of a sharded test group (started by ``sharded_helpers.launch``; not a test itself).

Arguments: the spec file, the group, the rank. For every config of the spec: a fresh
``TcpTransport`` (addresses shared through a FileStore), the test model sharded with
``fully_shard`` over this group's Gloo world, a ``StripedAverager``, ``DiLoCo``, the inner steps;
the per-commit global hashes, bytes sent and checks go to ``out-<group>-<rank>.json``.
"""

from __future__ import annotations

import json
import sys
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


def run_config(k: int, config: dict, group: int, rank: int, sizes: list[int], store) -> dict:
    if config.get("inner") == "refusals":
        return refusals()
    transport = TcpTransport(secret=SECRET, timeout_s=30)
    store.set(f"c{k}/addr/{group}/{rank}", transport.address)
    addresses = [[store.get(f"c{k}/addr/{g}/{r}").decode() for r in range(n)] for g, n in enumerate(sizes)]
    codec = compress.get_codec(config["codec"]) if config.get("codec") else None
    model = shard(make_model(kind=config.get("model", "small")), sizes[group])
    real = config.get("inner") == "adamw"
    inner = (torch.optim.AdamW if real else torch.optim.SGD)(model.parameters(), lr=1e-2)
    avg = StripedAverager(transport, Membership(addresses), group=group, rank=rank, codec=codec, timeout_s=30)
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
    dist.init_process_group("gloo", store=dist.FileStore(str(folder / f"group-{group}.store"), sizes[group]),
                            rank=rank, world_size=sizes[group])
    job = dist.FileStore(str(folder / "job.store"), sum(sizes))
    started = time.perf_counter()
    results = [run_config(k, c, group, rank, sizes, job) for k, c in enumerate(spec["configs"])]
    results.append({"seconds": time.perf_counter() - started})
    (folder / f"out-{group}-{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
