"""Child-process body for the all-gather fault tests (not a test module)."""

from __future__ import annotations

import os
import signal
import time

import torch

import compress
from transport import TokenBucket
from transport_helpers import BACKENDS, SECRET


def doomed_gather_peer(conn, n: int, index: int, kill_after_bytes: int, backend: str = "tcp") -> None:
    """Join an all_gather_mean with fp32 frames shaped to 2 MB/s, then SIGKILL itself once it
    has sent kill_after_bytes (its own collective may be done by then: it needs only the others'
    frames, which are not shaped; theirs need its own)."""
    t = BACKENDS[backend]("127.0.0.1", 0, secret=SECRET, timeout_s=10.0, chunk_bytes=64 << 10,
                          shaper=TokenBucket(2e6, 64 << 10))
    conn.send(t.address)
    ring = conn.recv()
    h = t.all_gather_mean(torch.ones(n), ring, index, tag="doomed", codec=compress.get_codec("fp32"))
    deadline = time.monotonic() + 20
    while t.bytes_sent < kill_after_bytes and time.monotonic() < deadline:
        time.sleep(0.001)
    conn.send("killing" if t.bytes_sent < n * 4 else "sent everything")
    del h
    os.kill(os.getpid(), signal.SIGKILL)
