"""Outer state of one fragment: the fp32 global copy of some parameters and its outer optimizer.

Plain DiLoCo has one fragment holding every parameter; Streaming DiLoCo has P of them, each with
its own slice of outer-optimizer state (the momentum of fragment f only moves when f syncs).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn as nn
import xxhash

from compress.fingerprint import fingerprint
from compress.fingerprint_parts import rows_part
from diloco.engine.outer import OuterOptimizerFactory, nesterov
from diloco.engine.shard_layout import local_view
from diloco.engine.streamed_outer import StreamedOuter, streamable


class OuterFragment:
    """Global fp32 copy of ``local_params`` plus an outer optimizer over it.

    When the parameters are DTensors (a model sharded with FSDP2), the global copy, the outer
    optimizer's state and every flat vector (pseudo-gradient, mean) cover only the part this rank
    holds (``local_views()``, concatenated in order: ``diloco.engine.shard_layout``).

    With the local parameters on a GPU and the global copy on the host (``--outer-device cpu``),
    the global copy lives in page-locked memory: the pseudo-gradient's device-to-host copies are
    queued together into one reused page-locked buffer and waited for once, and the merge's
    host-to-device copies are queued without waiting (the training loop's next kernels follow
    them on the stream); the global copy is not written again until they are done.
    """

    def __init__(
        self,
        names: Sequence[str],
        local_params: Sequence[torch.Tensor],
        *,
        outer_optimizer: OuterOptimizerFactory | None = None,
        device: torch.device | None = None,
    ) -> None:
        if not local_params:
            raise ValueError("a fragment needs at least one parameter")
        self.names = list(names)
        self.local_params = list(local_params)  # the model's parameters (DTensors when sharded)
        views = self.local_views()
        dev = device if device is not None else views[0].device
        #: local parameters on a CUDA device, global copy on the host: page-locked, copies queued
        self.staged = dev.type == "cpu" and any(p.is_cuda for p in views)
        self.global_params = [
            torch.empty(p.shape, dtype=torch.float32, device=dev, pin_memory=self.staged).copy_(p.detach())
            for p in views
        ]
        self.optimizer = (outer_optimizer or nesterov())(self.global_params)
        #: an SGD-family outer rule steps range by range, with exactly rounded operations (streamed_outer)
        self.streamed = StreamedOuter(self.global_params, self.optimizer) if streamable(self.optimizer) else None
        #: elements of the whole fragment; ``local_numel``: those this rank holds (the same unless sharded)
        self.numel = sum(p.numel() for p in self.local_params)
        self.local_numel = sum(p.numel() for p in self.global_params)
        self._staging: torch.Tensor | None = None  # page-locked landing buffer of the local values
        self._copies_to_device: list[torch.cuda.Event] = []  # the merge's queued copies
        self.hash_offset = 0  # where the global copy starts in the engine's state hash (``place_in_hash``)

    @torch.no_grad()
    def pseudo_gradient(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Flat fp32 ``θ_global − θ_local`` on the global copy's device, written into ``out`` when
        given (``local_numel`` fp32 values there; not with a staged global copy)."""
        if self.staged:
            return self._staged_pseudo_gradient()
        if out is None:
            out = torch.empty(self.local_numel, dtype=torch.float32, device=self.global_params[0].device)
        offset = 0  # written in place: one vector of transient memory, not two (pieces, then their cat)
        for g, p in zip(self.global_params, self.local_views()):
            torch.sub(g, p.detach().to(device=g.device, dtype=torch.float32), out=out[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return out

    def local_views(self) -> list[torch.Tensor]:
        """The parts of the parameters this rank holds, sharing their storage (the parameters
        themselves unless they are DTensors)."""
        return [local_view(p) for p in self.local_params]

    def _staged_pseudo_gradient(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(self.local_numel, dtype=torch.float32, pin_memory=True)
        offset = 0
        for p in self.local_views():
            self._staging[offset:offset + p.numel()].view_as(p).copy_(p.detach(), non_blocking=True)
            offset += p.numel()
        for d in self._devices():
            torch.cuda.current_stream(d).synchronize()
        return self.flat_global().sub_(self._staging)

    def _devices(self) -> set[torch.device]:
        return {p.device for p in self.local_views()}

    def _settle(self) -> None:
        """Wait for the merge's queued copies before the global copy is written again."""
        for done in self._copies_to_device:
            done.synchronize()
        self._copies_to_device = []

    @property
    def feeds_ranges(self) -> bool:
        """Whether final ranges of an exchange's mean can be stepped as they arrive (``on_final``):
        an SGD-family rule on a global copy in host memory that no queued copy reads (not staged)."""
        return self._steps_sgd() and not self.staged and self.global_params[0].device.type == "cpu"

    def _steps_sgd(self) -> bool:
        """SGD's rule is stepped here (``streamed``), not by the optimizer: checked at every use, as
        a loaded state may have changed the optimizer's settings."""
        return self.streamed is not None and streamable(self.optimizer)

    @torch.no_grad()
    def outer_step(self, mean_delta: torch.Tensor, attempt: int | None = None) -> None:
        """Use ``mean_delta`` (flat fp32) as the gradient of the global copy and step. The
        gradients are views of ``mean_delta`` (no copy); an outer optimizer must not write into
        its gradients (torch's do not, except with ``maximize=True``, which is refused). An
        SGD-family rule takes the ranges of ``attempt`` already stepped (``streamed.on_final``)."""
        if self._steps_sgd():
            self._settle()
            self.streamed.commit(mean_delta.to(device=self.global_params[0].device, dtype=torch.float32), attempt)
            return
        if mean_delta.numel() != self.local_numel:
            raise ValueError(f"pseudo-gradient has {mean_delta.numel()} values, fragment {self.local_numel}")
        if self.streamed is not None:
            self.streamed.forget_hash()  # torch's step below writes the copy (a fused one bumps no version)
        if any(group.get("maximize") for group in self.optimizer.param_groups):
            raise ValueError("an outer optimizer with maximize=True: the pseudo-gradient is a descent direction")
        self._settle()
        mean_delta = mean_delta.to(device=self.global_params[0].device, dtype=torch.float32).contiguous()
        offset = 0
        for g in self.global_params:
            g.grad = mean_delta[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        self.optimizer.step()
        for g in self.global_params:
            g.grad = None

    @torch.no_grad()
    def merge_into_model(self, alpha: float) -> None:
        """``θ_local ← α·θ_local + (1−α)·θ_global`` (α = 0 copies the global value exactly)."""
        for g, p in zip(self.global_params, self.local_views()):
            if alpha == 0.0:
                p.copy_(g, non_blocking=self.staged)
            else:
                p.lerp_(g.to(device=p.device, dtype=p.dtype, non_blocking=self.staged), 1.0 - alpha)
        if self.staged:
            for d in self._devices():
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(d))
                self._copies_to_device.append(done)

    def place_in_hash(self, offset: int, *, fold: bool = True) -> None:
        """The fragment's global copy starts at value ``offset`` of the engine's state hash (the
        fragments' global parameters in order): where its hash part is taken (``hash_part``);
        ``fold``: whether the streamed outer step takes it in its pass (off where the engine
        hashes otherwise: a sharded model)."""
        self.hash_offset = offset
        if self.streamed is not None:
            self.streamed.offset = offset
            self.streamed.fold_hash = fold and self.global_params[0].device.type == "cpu"

    def hash_part(self) -> int:
        """``compress.fingerprint_parts.rows_part`` of the global copy at ``hash_offset``: what the
        last streamed outer step folded into its pass when nothing wrote the copy since, else
        taken from the values now."""
        folded = self.streamed.folded_part() if self.streamed is not None else None
        if folded is not None:
            return folded
        pieces, at = [], self.hash_offset
        for g in self.global_params:
            pieces.append((g, at))
            at += g.numel()
        return rows_part(pieces)

    def flat_global(self) -> torch.Tensor:
        return torch.cat([g.detach().reshape(-1) for g in self.global_params])

    @torch.no_grad()
    def load_flat_global(self, flat: torch.Tensor) -> None:
        self._settle()
        if self.streamed is not None:
            self.streamed.begin()  # ranges stepped from the old values are void
        offset = 0
        for g in self.global_params:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def state_dict(self) -> dict:
        return {
            "global": {n: g.detach().clone() for n, g in zip(self.names, self.global_params)},
            "outer_optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        missing = set(self.names) - set(state["global"])
        if missing:
            raise KeyError(f"checkpoint lacks global parameters: {sorted(missing)[:5]}")
        self._settle()
        if self.streamed is not None:
            self.streamed.begin()
        for n, g in zip(self.names, self.global_params):
            src = state["global"][n]
            if src.shape != g.shape:
                raise ValueError(f"checkpoint parameter {n} has shape {tuple(src.shape)}, model {tuple(g.shape)}")
            g.copy_(src)
        self.optimizer.load_state_dict(state["outer_optimizer"])


def params_digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """XXH3-128 (16 bytes) of the tensors' fp32 bytes, in order, read in place (no copy of a CPU
    fp32 tensor; a GPU tensor is copied to the host): the groups' check of their initial
    parameters (``diloco.engine.initial``), taken once. Not a defence against forgery."""
    h = xxhash.xxh3_128()
    for t in tensors:
        c = t.detach()
        if c.device.type != "cpu" or c.dtype != torch.float32:
            c = c.to("cpu", torch.float32)
        h.update(memoryview(c.contiguous().reshape(-1).numpy()).cast("B"))
    return h.digest()


def params_hash(tensors: Sequence[torch.Tensor]) -> str:
    """The tensors' `compress.fingerprint` as 16 hex chars: what groups report after every round
    and compare. Computed where the tensors live (8 bytes reach the host from a GPU), the same on
    every device for the same bits. Not a defence against forgery — a group reports whatever hash
    it likes; state transfers carry their own SHA-256 (``state_blob``)."""
    return f"{fingerprint(tensors):016x}"


@contextlib.contextmanager
def global_weights_loaded(
    model: nn.Module, global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor]
) -> Iterator[nn.Module]:
    """Load ``global_params`` into ``local_params`` for the ``with`` block, then restore them."""
    with torch.no_grad():
        saved = [p.detach().clone() for p in local_params]
        for g, p in zip(global_params, local_params):
            p.copy_(g.to(device=p.device, dtype=p.dtype))
    try:
        yield model
    finally:
        with torch.no_grad():
            for s, p in zip(saved, local_params):
                p.copy_(s)
