"""Data parallel across groups: gradients averaged over the same links every inner step.

The baseline that DiLoCo is measured against (same model, data, links and transport; only what
is sent and how often differs). Call ``average_gradients()`` after ``backward()`` and before the
inner optimizer's step; it blocks until the mean gradient arrived.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn

from diloco.engine.averaging import Averager, Observing
from diloco.engine.initial import InitialSync, agree
from diloco.engine.outer_state import params_hash


class DataParallelAcrossGroups:
    """Averages the flat fp32 gradient of ``model`` across groups at every step.

    Speaks the engine's API (``step``, ``close``, ``round``, ``global_hash`` ...) so the worker
    and ``diloco.connect`` treat it like ``DiLoCo``; it has no fragments and no outer state.
    """

    mode = "dp"

    def __init__(self, model: nn.Module, averager: Averager, *, initial_sync: InitialSync = "check") -> None:
        self.model = model
        self.averager = averager
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        with torch.no_grad():
            start = [p.detach().float().clone() for p in self.params]
            agree(averager, start, initial_sync)
            for p, s in zip(self.params, start):
                p.copy_(s)
        self.fragments = [self.params]
        self.round = 0
        self.inner_step = 0
        self.next_sync = [1]
        self.sync_seconds = 0.0
        self.finished = False

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Replace every ``.grad`` by its mean over all groups (missing grads count as zero)."""
        t0 = time.perf_counter()
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().reshape(-1)
            for p in self.params
        ])
        mean = self.averager.all_reduce_mean(flat, round=self.round).to(flat.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = mean[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n
        self.round += 1
        self.sync_seconds += time.perf_counter() - t0

    def step(self) -> list:
        """Count the inner step; nothing else happens: the model itself is the global model."""
        self.inner_step += 1
        self._observe()
        return []

    def close(self) -> list:
        if not self.finished:
            self.finished = True
            self._observe()
        return []

    def _observe(self) -> None:
        if isinstance(self.averager, Observing):
            self.averager.observe(self, [])

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def global_hash(self) -> str:
        return params_hash(self.params)

    def global_weights(self) -> contextlib.AbstractContextManager[nn.Module]:
        return contextlib.nullcontext(self.model)
