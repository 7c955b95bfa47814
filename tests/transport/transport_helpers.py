"""Shared helpers for the transport tests (not a test module)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Iterator

import torch
from diloco_helpers import free_port

from transport import TcpTransport, TokenBucket
from transport.core import TransportBase
from transport.grpclink import GrpcTransport

SECRET = b"test-secret-0123456789"


BACKENDS = {"tcp": TcpTransport, "grpc": GrpcTransport}


@contextlib.contextmanager
def transports(g: int, backend: str = "tcp", **kw) -> Iterator[list[TransportBase]]:
    """g transports of the given backend on 127.0.0.1 ephemeral ports, closed on exit."""
    kw.setdefault("secret", SECRET)
    kw.setdefault("timeout_s", 10.0)
    made = [BACKENDS[backend]("127.0.0.1", 0, **kw) for _ in range(g)]
    try:
        yield made
    finally:
        for t in made:
            t.close(flush_timeout_s=1.0)


def run_ring(ts: list[TcpTransport], xs: list[torch.Tensor], tag: str, **kw) -> list[torch.Tensor]:
    """All-reduce xs[i] on ts[i] over the ring of all ts; returns every member's result."""
    ring = [t.address for t in ts]
    handles = [t.all_reduce(x, ring, i, tag=tag, **kw) for i, (t, x) in enumerate(zip(ts, xs))]
    return [h.wait() for h in handles]


def closed_port_address() -> str:
    """An address on 127.0.0.1 where nothing listens."""
    return f"127.0.0.1:{free_port()}"


def doomed_peer(conn, n: int, index: int, kill_after_bytes: int, backend: str = "tcp") -> None:
    """Child process body: join an all-reduce, then SIGKILL itself once it has sent some bytes."""
    t = BACKENDS[backend]("127.0.0.1", 0, secret=SECRET, timeout_s=10.0, chunk_bytes=64 << 10, shaper=TokenBucket(2e6, 64 << 10))
    conn.send(t.address)
    ring = conn.recv()
    x = torch.ones(n)
    h = t.all_reduce(x, ring, index, tag="doomed")
    deadline = time.monotonic() + 20
    while t.bytes_sent < kill_after_bytes and not h.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    conn.send("done" if h.done() else "killing")
    os.kill(os.getpid(), signal.SIGKILL)
