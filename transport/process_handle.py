"""A collective run by the data-plane process (``transport.process``), seen from the trainer: the
shared-memory segments its vectors cross, and its pending result (``ProcessHandle``), copied out of
the segment once the child says it is done.

A segment is a memfd mapped here and in the data-plane process; segments come in power-of-two
size classes of at least 1 MiB, so that collectives of similar sizes reuse them.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from .control import error_from_spec
from .errors import TransportError
from .ring_collective import Handle
from .streams import SideStream

_MIN_SEGMENT = 1 << 20


class Segment:
    """One shared-memory segment: a memfd mapped here and in the data-plane process."""

    def __init__(self, sid: int, size: int) -> None:
        self.id, self.size = sid, size
        self.fd = os.memfd_create(f"dataplane-{sid}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def vector(self, offset: int, n: int) -> torch.Tensor:
        return self.bytes[offset : offset + 4 * n].view(torch.float32)


def segment_size(nbytes: int) -> int:
    """Size class of a segment holding nbytes: a power of two of at least 1 MiB (so segments
    are reused across collectives of similar sizes)."""
    return max(_MIN_SEGMENT, 1 << (max(nbytes, 1) - 1).bit_length())


class ProcessHandle(Handle):
    """The pending result of a collective run by the data-plane process (as `transport.Handle`).

    ``owner``: the ``ProcessTransport`` that started it, which takes ``seg`` back once the results
    are copied out (``release``) and sends the child an abort (``send_quietly``)."""

    def __init__(self, owner: Any, rid: int, tag: str, seg: Segment, x_like: torch.Tensor,
                 views: dict[str, torch.Tensor], out: torch.Tensor | None, sent: torch.Tensor | None,
                 stream: SideStream | None = None) -> None:
        super().__init__(tag)
        self._owner, self._rid, self._seg, self._views = owner, rid, seg, views
        self._like, self._out, self._sent_out = x_like, out, sent
        self._stream = stream  # CUDA: the results are copied to the device on this side stream

    def _take_reply(self, reply: dict) -> None:
        """Copy the results out of shared memory (reader thread), free the segment, wake waiters."""
        try:
            if "error" in reply:
                self._error = error_from_spec(reply["error"])
            elif self._stream is None:
                self._copy_results()
            else:
                with self._stream.running():  # complete before wait() returns
                    self._copy_results()
                self._stream.hand_over(self._result, self.sent)
        except Exception as e:  # a copy to a device that failed: the caller must hear of it
            self._error = TransportError(f"copying the result of {self.tag!r} out of shared memory failed: {e}")
        finally:
            self._owner.release(self._seg)
            self._event.set()

    def _copy_results(self) -> None:
        self._result = self._copy_out(self._views["out"], self._out)
        if "sent" in self._views:
            self.sent = self._copy_out(self._views["sent"], self._sent_out)

    def _copy_out(self, view: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        if into is None:
            into = torch.empty(view.numel(), dtype=torch.float32, device=self._like.device)
        return into.copy_(view)

    def abort(self, reason: str) -> None:
        """End the collective now if it still runs (as `transport.Handle.abort`)."""
        if not self._event.is_set():
            self._owner.send_quietly({"op": "abort", "id": self._rid, "reason": reason})
