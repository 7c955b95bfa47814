"""Stream order for collectives on CUDA tensors.

A collective runs in a thread of its own. Its kernels (decode, sum, encode) and its copies go on a
side stream, never on the caller's stream, so they neither queue behind the training loop's
kernels nor hold them up, and the host-side waits of its copies wait for its own work only.

Order with the caller's stream:

* before: the side stream waits for an event recorded on the caller's stream when the collective
  was started, so x (and a caller's ``out``) hold what the caller wrote before starting it;
* after: the side stream is synchronized before ``wait()`` returns, so anything the caller
  launches after that sees the result; and tensors the collective allocated and hands back are
  marked as used on the caller's stream (``record_stream``), so the caching allocator does not
  give their memory to the next collective while the caller's kernels still read it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class SideStream:
    """A side stream on ``device`` for work the caller starts and another thread runs (a
    collective; `diloco.exchange.quorum_averager`'s attempts); create it on the caller's thread, at the
    start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.caller = torch.cuda.current_stream(device)
        self.ready = torch.cuda.Event()
        self.ready.record(self.caller)
        self.stream = torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Make the side stream current (in the collective's thread) after the caller's writes;
        on the way out, wait for everything queued on it, even if the body raised."""
        torch.cuda.set_device(self.device)
        try:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.ready)
                yield
        finally:
            self.stream.synchronize()

    def hand_over(self, *tensors: torch.Tensor | None) -> None:
        """Mark results the caller will use on its stream (call after ``running``)."""
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(self.caller)


def side_stream_for(x: torch.Tensor) -> SideStream | None:
    """A `SideStream` for a collective on x (None for a tensor not on a CUDA device)."""
    return SideStream(x.device) if x.device.type == "cuda" else None
