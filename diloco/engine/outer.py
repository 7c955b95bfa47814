"""Outer optimizers: factories that build a ``torch.optim`` optimizer over the global parameters.

The engine owns the fp32 global copy, so the user passes a factory rather than an optimizer:
``DiLoCo(..., outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9,
nesterov=True))``. Any ``torch.optim`` optimizer works; the pseudo-gradient is its ``.grad``.
Without one the engine takes ``by_mode(mode)``: each sync mode's own default (below).

Update rules, per fragment, with Δ = θ_global − θ_local (a descent direction), M groups, Δ̄ the
mean over groups, t the round; tags as in docs/algorithms.md ([V] verified, [S] secondary source).

* Outer Nesterov, every DiLoCo implementation (docs/algorithms.md §0.1 [V]), on an outer gradient u::

      v ← μ·v + u;   θ_global ← θ_global − η·(u + μ·v)          (torch SGD(nesterov=True))

* ``blocking`` DiLoCo (§1.1 [V]): u(t) = Δ̄(t); then θ_local ← θ_global.
* ``overlap``, Streaming DiLoCo (§3.3 [V]): u(t) = Δ̄(t) applied τ steps after the launch, then
  θ_local ← α·θ_local + (1−α)·θ_global (α = 0.5).
* ``eager`` (Kale et al. 2025, §4, formula [S]), group m at the sync of round t::

      u_m(t) = ( Δ_m(t) + Σ_{m'≠m} Δ_m'(t−1) ) / M = Δ̄(t−1) + ( Δ_m(t) − Δ_m(t−1) ) / M
      (round 0: u_m(0) = Δ_m(0)/M);   θ_local ← θ_global  (α = 0)

  the groups' θ_global copies differ during training and are averaged once at the end.
* ``delayed``, the naive 1-outer-step delay (§4 [V]): u(t) = Δ̄(t−1), round 0 applies nothing, the
  last mean is applied when training ends; θ_local ← θ_global.
* ``co2`` (Sun et al. 2024, §5 [S]; released code [V]): the stale g = Δ̄(t−1) of ``delayed``, then
  ``CO2Outer`` (heavy-ball momentum with a staleness-gap penalty Λ and element-wise clipping φ)::

      Λ = 1 + η·‖m‖/‖g‖ (adaptive; or a constant ≥ 1);  m ← clamp(β·m + g/Λ, −φ, φ);  θ ← θ − η·m

Per-mode defaults (``MODE_DEFAULTS``; measured with ``diloco run``, 2 groups, H = 30, 300 steps,
the demo GPT; eval loss, blocking 0.7/0.9 = 2.2906):

* blocking, overlap: Nesterov η 0.7, μ 0.9 — DiLoCo's published values (§1.2 [V]).
* eager: Nesterov η 0.7, **μ 0.5**. Half of u is one round old, and a one-round-old gradient fed
  to μ = 0.9 overshoots and rings (on a quadratic where a round closes a fraction c = 0.6 of the
  gap, the contraction per round is 0.72 for blocking, 0.90 for eager at μ 0.9, 0.71 at μ 0.5).
  μ 0.9 → 2.5417, 0.7 → 2.4064, **0.5 → 2.3631**, 0.3 → 2.3699, SGD η 1 → 2.3634;
  at H = 10: μ 0.9 → 2.8502, 0.5 → 2.3049.
* delayed: **η 0.7, μ 0** (plain SGD). With Nesterov 0.7/0.9 the whole update is stale and training
  diverges (5.8942, above the initial 5.49); the Eager paper also lowers the outer step for this
  variant (Table 2: 3.01 → 2.73 "lowered LR"). μ 0.5 → 2.6894, η 0.35/μ 0.9 → 2.9254,
  η 0.5/μ 0.3 → 2.4866, SGD η 1.0 → 2.5292, **0.7 → 2.4793**, 0.5 → 2.4921, 0.4 → 2.5278.
* co2: the authors' released defaults for ≤ 16 workers (§5.1 [V]): η 1.0, β 0.0, φ 1.0, with the
  adaptive penalty: 2.4793; β 0.5 → 2.5769, η 0.7 → 2.5071, η 0.7/β 0.3 → 2.4961.

Seed 7, same setting: blocking 2.2924; eager 2.3803 (μ 0.9: 2.6333); delayed 2.4796 (Nesterov
0.7/0.9: 4.3411, diverging); co2 2.4831. What is left of the gaps at this size (0.44M parameters,
10 outer rounds): eager +3 to +4 % against blocking (+2.9 % with 4 layers of width 256, 3.2M
parameters; at H = 10 eager 2.3049 against blocking 2.3419), about what the Eager paper reports
against DiLoCo at its smallest scale (35M: 3.62 vs 3.54, +2.3 %; under 1 % only at 1B;
docs/algorithms.md §3.5, §4 [V]); delayed and co2 about +8 % (+5 % at H = 10), where the paper's naive delay costs +2.2 % with a
lowered lr at 500M and +12.7 % without.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from diloco.engine.modes import CO2_DEFAULTS, MODE_DEFAULTS  # noqa: F401  (re-exported: the defaults' old home)

#: builds the outer optimizer over a fragment's global parameters. Its ``step`` sees ``p.grad`` as views
#: of the round's mean, valid for that step only (the next round's mean is written into the same vector):
#: an optimizer that keeps a gradient across steps keeps a copy (torch's optimizers keep their own state).
OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def nesterov(lr: float = 0.7, momentum: float = 0.9) -> OuterOptimizerFactory:
    """Outer Nesterov (DiLoCo default: lr 0.7, momentum 0.9). Momentum 0 is plain SGD (the same
    update; torch refuses ``nesterov=True`` without momentum)."""
    if momentum == 0:
        return lambda params: torch.optim.SGD(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)


def sgd(lr: float = 1.0, momentum: float = 0.0) -> OuterOptimizerFactory:
    """Plain outer SGD; lr 1, momentum 0 is parameter averaging (FedAvg / Local SGD)."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def adam(lr: float = 1e-3, eps: float = 0.1) -> OuterOptimizerFactory:
    """Outer Adam (FedOpt); DiLoCo found it unstable unless eps is large (0.1)."""
    return lambda params: torch.optim.Adam(params, lr=lr, eps=eps)


class SparseLoCo:
    """SparseLoCo's outer rule (Sarfi et al. 2025; docs/algorithms.md §8.2): plain SGD with no
    momentum on the mean of what the groups sent, the error-feedback residual standing in for
    outer momentum. Per group r and fragment, with Δ_r its pseudo-gradient and C the codec::

        y_r = β·e_r + Δ_r;   send C(y_r);   e_r ← y_r − decode(C(y_r))
        θ ← θ − α·mean_r decode(C(y_r))

    Defaults as Covenant-72B ran it: α = 1 (``lr``), β = 0.95 (``beta``), top-k of every 64 x 64
    tile of a 2-D tensor and every 4096 values of a 1-D one (``tile``; None: chunks of the flat
    vector as they come). The engine reads ``error_decay`` and ``tile``: it needs an averager with
    error feedback (``--codec topk``, or another codec that needs it) and lays each fragment out
    tile-major (``diloco.engine.tiles``) before the residual and the codec see it.
    """

    name = "sparseloco"

    def __init__(self, lr: float = 1.0, beta: float = 0.95, tile: int | None = 64) -> None:
        if not lr > 0:
            raise ValueError(f"sparseloco: lr must be > 0, got {lr}")
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"sparseloco: beta (the residual's decay) must be in [0, 1], got {beta}")
        if tile is not None and tile < 1:
            raise ValueError(f"sparseloco: tile must be >= 1 or None, got {tile}")
        self.lr, self.error_decay, self.tile = lr, beta, tile

    def __call__(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr)

    def __repr__(self) -> str:
        return f"sparseloco(lr={self.lr}, beta={self.error_decay}, tile={self.tile})"


def sparseloco(lr: float = 1.0, beta: float = 0.95, tile: int | None = 64) -> SparseLoCo:
    """SparseLoCo's outer rule (``SparseLoCo``): outer SGD lr ``lr``, residual decay ``beta``,
    top-k per ``tile`` x ``tile`` tile."""
    return SparseLoCo(lr, beta, tile)


def mode_lr(mode: str) -> float:
    """Default outer lr of a sync mode (``co2``: ``--co2-lr``'s)."""
    return CO2_DEFAULTS["lr"] if mode == "co2" else _mode(mode)[0]


def mode_momentum(mode: str) -> float:
    """Default outer momentum of a sync mode (``co2``: ``--co2-momentum``'s)."""
    return CO2_DEFAULTS["momentum"] if mode == "co2" else _mode(mode)[1]


def _mode(mode: str) -> tuple[float, float]:
    if mode not in MODE_DEFAULTS:
        known = ", ".join([*MODE_DEFAULTS, "co2"])
        raise ValueError(f"no outer-optimizer default for mode {mode!r}; modes: {known}")
    return MODE_DEFAULTS[mode]


def by_mode(mode: str) -> OuterOptimizerFactory:
    """The outer optimizer a sync mode uses by default: ``co2()`` for ``co2``, else Nesterov with
    ``MODE_DEFAULTS[mode]``."""
    if mode == "co2":
        return co2()
    return nesterov(*_mode(mode))


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

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.0, clip: float = 1.0,
                 penalty: str | float = "adaptive", eps: float = 1e-12) -> None:
        if penalty != "adaptive" and not (isinstance(penalty, (int, float)) and penalty >= 1.0):
            raise ValueError(f"penalty must be 'adaptive' or a number >= 1, got {penalty!r}")
        if clip < 0:
            raise ValueError(f"clip must be >= 0, got {clip}")
        super().__init__(params, dict(lr=lr, momentum=momentum, clip=clip, penalty=penalty, eps=eps))
        #: None: the norms are of these tensors (torch's vector_norm). Else Σx² over a list of
        #: tensors (fp64): a sharded engine sets it to an exactly rounded sum over every rank's shard
        self.sum_squares: Callable[[list[torch.Tensor]], float] | None = None

    def _norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.sum_squares is None:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
        return torch.tensor(math.sqrt(self.sum_squares(tensors)), dtype=torch.float32, device=tensors[0].device)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - documented on the class
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            bufs = [self.state[p].get("momentum_buffer") for p in params]
            if group["penalty"] == "adaptive":
                g_norm = self._norm([p.grad for p in params])
                if any(b is None for b in bufs):
                    gap = torch.zeros((), device=g_norm.device)
                else:
                    gap = group["lr"] * self._norm(bufs)
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


def co2(lr: float = 1.0, momentum: float = 0.0, clip: float = 1.0, penalty: str | float = "adaptive") -> OuterOptimizerFactory:
    """Factory for ``CO2Outer``; the defaults are ``CO2_DEFAULTS`` (the authors' for <= 16 workers:
    momentum 0; it was 0.5 here, unlike ``--co2-momentum``, and measured worse: module doc)."""
    return lambda params: CO2Outer(params, lr=lr, momentum=momentum, clip=clip, penalty=penalty)
