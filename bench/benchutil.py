"""Small helpers shared by the benchmarks (not a benchmark)."""
from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Callable


def pin_malloc() -> str:
    """Stop glibc from returning freed buffers to the OS between calls (and re-faulting them):
    sets M_MMAP_THRESHOLD to 32 MiB and M_TRIM_THRESHOLD to 1 GiB in this process. Without it a
    plain tensor clone() swings between 3 and 40 GB/s from run to run on the 2-core machine.
    Returns a description of the setting in force."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, 32 << 20) and libc.mallopt(-1, 1 << 30)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        return "pinned: M_MMAP_THRESHOLD=32MiB, M_TRIM_THRESHOLD=1GiB" if ok else "default"
    except OSError:
        return "default"


def append_record(path: str | Path, record: dict) -> None:
    """Add ``record`` to the JSON list in ``path`` (made if missing): a bench's results, run by run."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*old, record], indent=1) + "\n")


def dp_result_from(path: str, record: dict, same: tuple[str, ...],
                   accepts: Callable[[dict], bool] = lambda r: True) -> dict:
    """``--dp-from``: the data-parallel result (a record's ``"dp"``, with ``"from"``: the run that made it)
    of the last record in the JSON list at ``path`` whose ``same`` keys equal ``record``'s and that
    ``accepts`` takes. SystemExit saying why where the file cannot be read, is not a list of records, or
    holds no such record: called before a bench's own run, so a wrong path costs no run."""
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SystemExit(f"--dp-from {path}: cannot read a JSON list of records: {e}") from None
    if not isinstance(records, list):
        raise SystemExit(f"--dp-from {path}: not a JSON list of bench records")
    found = [r for r in records if isinstance(r, dict) and isinstance(r.get("dp"), dict)
             and all(r.get(k) == record[k] for k in same) and accepts(r)]
    if not found:
        raise SystemExit(f"--dp-from {path}: no record with a \"dp\" result and the same {', '.join(same)}")
    return {**found[-1]["dp"], "from": found[-1]["dp"].get("from") or f"{path}: {found[-1].get('command', '?')}"}


class GlooBaseline:
    """A ``torch.distributed`` Gloo process group of the bench's members: the all-reduce every
    PyTorch user already has, run over the same link as the transport's ring (bench only).

    Member 0 hosts the TCPStore on ``host`` (an ephemeral port; its ``address`` goes round with the
    ring's addresses), every member then joins with ``connect(ring)``. Gloo binds its own sockets to
    ``host`` too, so inside a network namespace it uses that namespace's link."""

    def __init__(self, host: str, index: int, size: int, timeout_s: float = 120.0) -> None:
        import datetime

        import torch.distributed as dist

        self.host, self.index, self.size = host, index, size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, size, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False) if index == 0 else None
        self.address = f"{host}:{self.store.port}" if self.store is not None else ""
        self.group = None

    def connect(self, ring: list[str]) -> None:
        """Join the group whose store member 0 announced (``ring[0]``)."""
        import torch.distributed as dist

        if self.store is None:
            host, port = ring[0].rsplit(":", 1)
            self.store = dist.TCPStore(host, int(port), self.size, is_master=False, timeout=self.timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        self.group = dist.ProcessGroupGloo(self.store, self.index, self.size, opts)

    def all_reduce_mean(self, x) -> None:
        """The mean of every member's ``x``, in place: Gloo's sum, then a division (what a user writes)."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.group.allreduce([x], opts).wait()
        x.div_(self.size)

    @staticmethod
    def bytes_sent(n: int, size: int) -> int:
        """Bytes a member of Gloo's ring all-reduce sends for n fp32 values: 2(G-1)/G x 4n (computed,
        not counted: Gloo has no byte counter)."""
        return 2 * (size - 1) * 4 * n // size

    def close(self) -> None:
        self.group = None
        self.store = None


def bench_codec(spec: str):
    """The codec a bench case names: a ``compress`` codec name, or ``NAME/fast`` for a 4-bit codec
    without its scale search (what ``diloco run --codec NAME --codec-fast true`` uses)."""
    import compress

    name, _, variant = spec.partition("/")
    if variant not in ("", "fast"):
        raise ValueError(f"unknown codec variant {variant!r} in {spec!r} (known: NAME/fast)")
    return compress.get_codec(name, search=False) if variant else compress.get_codec(name)


def spawn_members(member, cfgs: list[dict]) -> tuple[list, list]:
    """One spawned process per config, each running ``member(pipe_end, cfg)``; returns this
    side's pipe ends and the processes (daemons), in the configs' order."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for cfg in cfgs:
        a, b = ctx.Pipe()
        p = ctx.Process(target=member, args=(b, cfg), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    return pipes, procs
