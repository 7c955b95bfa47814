"""Outer optimizers: factories that build a ``torch.optim`` optimizer over the global parameters.

The engine owns the fp32 global copy, so the user passes a factory rather than an optimizer:
``DiLoCo(..., outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9,
nesterov=True))``. Any ``torch.optim`` optimizer works; the pseudo-gradient is its ``.grad``.
"""

from __future__ import annotations

from typing import Callable

import torch

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def nesterov(lr: float = 0.7, momentum: float = 0.9) -> OuterOptimizerFactory:
    """Outer Nesterov (DiLoCo default: lr 0.7, momentum 0.9)."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)


def sgd(lr: float = 1.0, momentum: float = 0.0) -> OuterOptimizerFactory:
    """Plain outer SGD; lr 1, momentum 0 is parameter averaging (FedAvg / Local SGD)."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def adam(lr: float = 1e-3, eps: float = 0.1) -> OuterOptimizerFactory:
    """Outer Adam (FedOpt); DiLoCo found it unstable unless eps is large (0.1)."""
    return lambda params: torch.optim.Adam(params, lr=lr, eps=eps)


def by_name(name: str, lr: float, momentum: float) -> OuterOptimizerFactory:
    """Factory for a configured outer optimizer name: ``nesterov``, ``sgd`` or ``adam``."""
    if name == "nesterov":
        return nesterov(lr, momentum)
    if name == "sgd":
        return sgd(lr, momentum)
    if name == "adam":
        return adam(lr)
    raise ValueError(f"unknown outer optimizer {name!r}; choose nesterov, sgd or adam")


class CO2Outer(torch.optim.Optimizer):
    """CO2's outer step (Sun et al., ICLR 2024) on a one-round-stale averaged pseudo-gradient g.

    Per parameter group (one fragment), with β = ``momentum``, η = ``lr``, φ = ``clip``::

        Λ = 1 + η·‖m_prev‖ / (‖g‖ + ε)        if penalty == "adaptive"   (Λ = penalty if a number)
        m = β·m_prev + g / Λ
        m = clamp(m, −φ, φ)                   (element-wise; skipped when φ == 0)
        θ = θ − η·m

    η·‖m_prev‖ is the distance the global model moved since the stale round started (the
    staleness gap): the gradient computed at the old point is damped when the model has since
    moved far compared to the size of that gradient, and Λ = 1 when it has not moved. The paper's
    exact Eq. 3 could not be checked (docs/algorithms.md §5.1); this form follows its description
    (Λ ≥ 1, growing with the gap). The authors' released code divides by a constant instead
    (``penalty=1.0`` reproduces it) and its element-wise clamp is a no-op by accident; here the
    clamp is applied.
    """

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.5, clip: float = 1.0,
                 penalty: str | float = "adaptive", eps: float = 1e-12) -> None:
        if penalty != "adaptive" and not (isinstance(penalty, (int, float)) and penalty >= 1.0):
            raise ValueError(f"penalty must be 'adaptive' or a number >= 1, got {penalty!r}")
        if clip < 0:
            raise ValueError(f"clip must be >= 0, got {clip}")
        super().__init__(params, dict(lr=lr, momentum=momentum, clip=clip, penalty=penalty, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - documented on the class
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            bufs = [self.state[p].get("momentum_buffer") for p in params]
            if group["penalty"] == "adaptive":
                g_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
                if any(b is None for b in bufs):
                    gap = torch.zeros((), device=g_norm.device)
                else:
                    gap = group["lr"] * torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b) for b in bufs]))
                lam = 1.0 + gap / (g_norm + group["eps"])
            else:
                lam = torch.tensor(float(group["penalty"]))
            group["last_penalty"] = float(lam)
            for p, buf in zip(params, bufs):
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                buf.mul_(group["momentum"]).add_(p.grad / lam.to(p.device))
                if group["clip"] > 0:
                    buf.clamp_(-group["clip"], group["clip"])
                p.add_(buf, alpha=-group["lr"])


def co2(lr: float = 1.0, momentum: float = 0.5, clip: float = 1.0, penalty: str | float = "adaptive") -> OuterOptimizerFactory:
    """Factory for ``CO2Outer``."""
    return lambda params: CO2Outer(params, lr=lr, momentum=momentum, clip=clip, penalty=penalty)
