"""The outer step of an SGD-family outer rule, taken range by range while the mean still arrives.

A blocking sync used to wait for the whole mean, then step the outer optimizer over the whole
fragment, then copy it into the model: two passes over the model after the last byte came in. The
rings know earlier which parts of the mean are final (the owner's chunk once it divided the sum, the
others' chunks as the all-gather brings them), and tell the averager's caller (``on_final``). For
``torch.optim.SGD`` (momentum, Nesterov or neither; no dampening, weight decay or ``maximize``) the
step is element-wise, so each final range is stepped as soon as it is known, while later chunks are
still on the wire: by a thread of its own, which the rings only hand the range to (stepped in the
rings' threads, its work and its interpreter-lock waits sat in the rings' pipeline and made a
loopback sync slower, not faster: bench/pages/sync_stall.md).

A range is stepped into scratch copies (θ', v'), never into the global copy itself: the exchange
may still be rolled back (a member's rings failed, or its vote said no) and retried with another
quorum. When the exchange commits, ``commit`` steps the ranges no ring reported (another rank's
stripes, shared inside the group afterwards; or every range, for an averager that reports none)
and swaps the scratch in.

The round's state hash is folded into the same pass: ``compress.fingerprint`` is a sum over the
values at their offsets in the stream (``compress.fingerprint_parts``), so each range adds its part
right after it is stepped, while it is still in cache, and the commit leaves the new state's part
(``folded_part``) for the engine's hash: no second pass over the model after the last byte came in.

Each element is computed with exactly rounded operations only (a product, then a sum; no fused
multiply-add), so its value does not depend on which range it was stepped in, on how torch splits
the loop across threads or vector lanes, or on whether a ring reported it: every group gets the
same bits whatever its ranks, stripes or threads. torch's own ``SGD.step`` fuses ``a + α·b`` in its
vector loop and not in its tail, so it differs from this in the last bit of some elements; the
engine uses this rule for every outer step of such an optimizer, streamed or not.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Sequence

import torch

from compress.fingerprint import MASK64
from compress.fingerprint_parts import rows_part

try:  # the C kernel (compress/_native.c: sgd_step), where it is built; the same bits as the torch path
    from compress import _native

    _KERNEL = getattr(_native, "sgd_step", None)
except ImportError:
    _KERNEL = None
#: False forces the torch path (tests compare the two); COMPRESS_NATIVE=0 sets it at import
USE_KERNEL = os.environ.get("COMPRESS_NATIVE", "1") != "0"


def streamable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ``torch.optim.SGD`` whose step is element-wise with no state but
    its momentum buffer: no dampening, weight decay or ``maximize``; one parameter group."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return False
    g = optimizer.param_groups[0]
    return not g["dampening"] and not g["weight_decay"] and not g["maximize"]


@torch.no_grad()
def sgd_range(theta: torch.Tensor, buf: torch.Tensor | None, u: torch.Tensor, *, lr: float, momentum: float,
              nesterov: bool, theta_out: torch.Tensor, buf_out: torch.Tensor | None) -> None:
    """One SGD step of ``theta`` by gradient ``u`` (1-D views of equal length), written to
    ``theta_out`` and, with momentum, the new momentum buffer to ``buf_out`` (``buf`` None: the
    first step, which starts the buffer at ``u``); the same rule as ``torch.optim.SGD``:
    ``v ← μ·v + u``; ``g = u + μ·v`` (Nesterov) or ``v``; ``θ ← θ − lr·g``. On the host, one
    pass of a C kernel (interpreter lock released once) where it is built."""
    views = (theta, u, theta_out) + (() if buf is None else (buf,)) + (() if buf_out is None else (buf_out,))
    if any(t.numel() != theta.numel() for t in views):
        raise ValueError(f"sgd_range: views of {[t.numel() for t in views]} values, want equal lengths")
    if _KERNEL is not None and USE_KERNEL and all(_plain_cpu(t) for t in views) \
            and (buf_out is not None or not momentum):
        _KERNEL(theta.data_ptr(), 0 if buf is None else buf.data_ptr(), u.data_ptr(), theta_out.data_ptr(),
                0 if buf_out is None else buf_out.data_ptr(), theta.numel(), float(lr), float(momentum), bool(nesterov))
        return
    if momentum:
        assert buf_out is not None
        if buf is None:
            buf_out.copy_(u)
        else:
            torch.mul(buf, momentum, out=buf_out)
            buf_out.add_(u)
        if nesterov:
            step = torch.mul(buf_out, momentum)
            step.add_(u)
        else:
            step = buf_out.clone()
    else:
        step = u.clone()
    step.mul_(lr)
    torch.sub(theta, step, out=theta_out)


def _plain_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


IDLE_S = 30.0  # a stepping thread given nothing for this long ends (what it missed, commit steps)


class StreamedOuter:
    """The outer step of one fragment's global copy (``params``) under an SGD optimizer
    (``streamable``), range by range (see the module doc). ``on_final`` takes final ranges of the
    mean, from any thread; ``commit`` finishes the step with the whole mean and makes it the new
    state; ``begin`` starts a new exchange; ``stop`` ends the stepping thread and takes no more
    ranges until the next ``begin`` (an exchange abandoned, or committed).

    Ranges go to scratch copies θ', v' (two more copies of the fragment, made when the first range
    arrives), which the commit swaps in: the global tensors keep their identity but not their
    storage (a view taken of one before a commit does not follow it). A commit with no range
    stepped steps in place and needs no scratch.

    ``offset``: the stream offset (in values) of the fragment's first value in the engine's state
    hash, where the hash parts of its ranges are taken (``folded_part``); ``fold_hash``: whether
    they are (the engine sets it off where its hash is taken otherwise: a sharded model's)."""

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.SGD, offset: int = 0) -> None:
        if not streamable(optimizer):
            raise ValueError("a streamed outer step needs torch.optim.SGD without dampening, weight decay or maximize")
        self.params = list(params)
        self.optimizer = optimizer
        self.numel = sum(p.numel() for p in self.params)
        ends, total = [], 0
        for p in self.params:
            total += p.numel()
            ends.append(total)
        self._ends = ends  # each parameter's end in the flat vector
        self._theta: list[torch.Tensor] | None = None  # scratch θ', v' (made on first use, reused)
        self._buf: list[torch.Tensor] | None = None
        self._lock = threading.Lock()
        self.offset = offset
        #: fold the hash into the pass only on the host: on a GPU the hash stays there, read once
        self.fold_hash = all(p.device.type == "cpu" for p in self.params)
        self._done: list[tuple[int, int, int, int]] = []  # (attempt, lo, hi, hash part) stepped, in order
        #: (offset, the parameters' storage and versions, rows part) of the state the last commit made
        self._folded: tuple[int, tuple[tuple[int, int], ...], int] | None = None
        self._ranges: queue.SimpleQueue | None = None  # the stepping thread's work; None: no thread runs
        self._worker: threading.Thread | None = None
        self._open = False  # takes ranges (from begin() to stop())

    def begin(self) -> None:
        """A new exchange starts: nothing of it is stepped yet (ranges of the last one still
        queued are dropped)."""
        self.stop()
        with self._lock:
            self._done.clear()
            self._open = True
            self._folded = None

    def on_final(self, attempt: int, mean: torch.Tensor, lo: int, hi: int) -> None:
        """``mean[lo:hi]`` is final in ``attempt`` of the exchange: queue that range for the
        stepping thread, which steps it into the scratch (a later attempt steps its ranges again
        from the same state). Called from the rings' threads; returns at once."""
        with self._lock:
            if not self._open:  # a ring still running after its exchange was abandoned or committed
                return
            if self._ranges is None:
                self._ranges = queue.SimpleQueue()
                self._worker = threading.Thread(target=self._run, args=(self._ranges,), name="outer-step", daemon=True)
                self._worker.start()
            self._ranges.put((attempt, mean, lo, hi))

    def stop(self) -> None:
        """Let the stepping thread finish what is queued and end; take no more ranges."""
        with self._lock:
            ranges, worker, self._ranges, self._worker = self._ranges, self._worker, None, None
            self._open = False
        if ranges is not None and worker is not None:
            ranges.put(None)
            worker.join()

    def _run(self, ranges: queue.SimpleQueue) -> None:
        self._scratch()
        while True:
            try:
                item = ranges.get(timeout=IDLE_S)
            except queue.Empty:  # an exchange nobody commits: end; a late range starts another
                with self._lock:
                    if self._ranges is ranges:
                        self._ranges = self._worker = None
                return
            if item is None:
                return
            attempt, mean, lo, hi = item
            if not 0 <= lo < hi <= self.numel:  # not a range of this fragment: the commit steps what is missing
                continue
            part = self._step(mean, lo, hi, in_place=False)
            with self._lock:
                self._done.append((attempt, lo, hi, part))

    @torch.no_grad()
    def commit(self, mean: torch.Tensor, attempt: int | None) -> None:
        """The exchange committed with ``mean`` (1-D fp32, the whole fragment), the result of
        ``attempt`` (None: no ranges came from it): step what is left, then take the new state."""
        if mean.numel() != self.numel:
            raise ValueError(f"pseudo-gradient has {mean.numel()} values, fragment {self.numel}")
        self.stop()  # every range reported so far is stepped
        with self._lock:
            done = _trusted(self._done, attempt)
            self._done.clear()
            self._folded = None
        if not done:
            self._fold(self._step(mean, 0, self.numel, in_place=True))
            return
        self._scratch()
        at, total, disjoint = 0, 0, True
        for lo, hi, part in done + [(self.numel, self.numel, 0)]:
            if lo > at:
                total += self._step(mean, at, lo, in_place=False)
            disjoint &= lo >= at
            total += part
            at = max(at, hi)
        self._swap()
        self._fold(total if disjoint else None)

    def _fold(self, total: int | None) -> None:
        """Keep the hash part of the state just committed (None: the ranges overlapped, so their
        parts do not add up to it, or none were taken; the engine hashes the values instead)."""
        if total is not None and self.fold_hash:
            self._folded = (self.offset, self._identity(), total & MASK64)

    def forget_hash(self) -> None:
        """The global copy is written outside the stream (a step of torch's own rule): the folded
        part is void (a write that bumps no tensor's version, e.g. a fused optimizer's, included)."""
        self._folded = None

    def _identity(self) -> tuple[tuple[int, int], ...]:
        return tuple((p.data_ptr(), p._version) for p in self.params)

    def folded_part(self) -> int | None:
        """``compress.fingerprint_parts.rows_part`` of the global copy at ``offset`` (mod 2^64), as
        the last commit's pass took it; None when the copy was written since (a loaded state, a
        step outside the stream: any in-place write bumps a tensor's version), an exchange began,
        or ``offset`` moved."""
        f = self._folded
        if f is None or f[0] != self.offset or f[1] != self._identity():
            return None
        return f[2]

    def _scratch(self) -> None:
        with self._lock:
            if self._theta is None:
                self._theta = [_like(p) for p in self.params]
            if self._buf is None and self._momentum():
                self._buf = [_like(p) for p in self.params]

    def _momentum(self) -> float:
        return float(self.optimizer.param_groups[0]["momentum"])

    def _step(self, mean: torch.Tensor, lo: int, hi: int, *, in_place: bool) -> int:
        """Step flat range [lo, hi), cut at the parameters' boundaries: into the scratch, or
        (``in_place``: whole parameters) into the global copy and its momentum buffers. Returns
        the hash part (``rows_part`` at ``offset``) of the values written."""
        group = self.optimizer.param_groups[0]
        lr, mu, nesterov = float(group["lr"]), float(group["momentum"]), bool(group["nesterov"])
        start, part, fold = 0, 0, self.fold_hash
        for i, end in enumerate(self._ends):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                p = self.params[i]
                buf = self.optimizer.state[p].get("momentum_buffer") if mu else None
                sl = slice(a - start, b - start)
                if in_place:
                    theta_out = p.view(-1)[sl]
                    buf_out = None if not mu else buf if buf is not None else \
                        self.optimizer.state[p].setdefault("momentum_buffer", _like(p))
                else:
                    assert self._theta is not None and (self._buf is not None or not mu)
                    theta_out = self._theta[i].view(-1)[sl]
                    buf_out = None if not mu else self._buf[i]
                sgd_range(p.view(-1)[sl], None if buf is None else buf.view(-1)[sl], mean[a:b], lr=lr, momentum=mu,
                          nesterov=nesterov, theta_out=theta_out, buf_out=None if buf_out is None else buf_out.view(-1)[sl])
                if fold:
                    part += rows_part([(theta_out, self.offset + a)])
            start = end
            if start >= hi:
                break
        return part

    def _swap(self) -> None:
        """θ' and v' become the global copy and the momentum buffers; the old ones, the scratch."""
        assert self._theta is not None
        mu = self._momentum()
        for i, p in enumerate(self.params):
            old = p.data
            p.data = self._theta[i]
            self._theta[i] = old
            if mu and self._buf is not None:
                state = self.optimizer.state[p]
                previous = state.get("momentum_buffer")
                state["momentum_buffer"] = self._buf[i]
                self._buf[i] = previous if previous is not None else _like(p)


def _trusted(stepped: list[tuple[int, int, int, int]], attempt: int | None) -> list[tuple[int, int, int]]:
    """The ranges of ``attempt`` in ``stepped`` ((attempt, lo, hi, hash part), in the order they
    were stepped) whose scratch values still hold: all of them, sorted, unless a range of another
    attempt was stepped after its first (attempts report in turn; one that did not may have
    overwritten them), then none (the commit steps the whole mean)."""
    if attempt is None:
        return []
    first = next((i for i, (a, *_rest) in enumerate(stepped) if a == attempt), None)
    if first is None or any(a != attempt for a, *_rest in stepped[first:]):
        return []
    return sorted((lo, hi, part) for _a, lo, hi, part in stepped[first:])


def _like(p: torch.Tensor) -> torch.Tensor:
    """Scratch for ``p`` that can take its place: page-locked where ``p`` is (a staged global copy)."""
    return torch.empty(p.shape, dtype=p.dtype, device=p.device, pin_memory=p.device.type == "cpu" and p.is_pinned())
