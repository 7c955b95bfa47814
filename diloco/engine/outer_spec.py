"""The outer rule's spec: the outer optimizers by name, what each is built from, and its checks.

``OUTER_RULES`` is the registry (``--outer-optimizer``'s choices); ``OuterSpec`` holds the settings
(``-1`` for the sync mode's default lr, momentum and merge factor, ``modes.MODE_DEFAULTS``), says
which are in force for a mode, checks them (``problems``: one sentence each) and builds the
optimizer factory the engine takes (``build``; ``co2`` mode: CO2's own step). Torch-free until
``build``: a configuration checks its outer rule without loading torch.

A new outer rule: its factory in ``outer.py`` and one entry in ``OUTER_RULES``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from diloco.engine.modes import CO2_DEFAULTS, MODE_DEFAULTS, MODE_TRAITS

#: the outer optimizers by name: how each is built from a spec (``outer`` is ``diloco.engine.outer``)
OUTER_RULES: dict[str, Callable[[Any, "OuterSpec", str], Any]] = {
    "nesterov": lambda outer, s, mode: outer.nesterov(s.lr_for(mode), s.momentum_for(mode)),
    "sgd": lambda outer, s, mode: outer.sgd(s.lr_for(mode), s.momentum_for(mode)),
    "adam": lambda outer, s, mode: outer.adam(s.lr_for(mode)),
    "sparseloco": lambda outer, s, mode: outer.sparseloco(s.lr_for(mode), s.sparseloco_beta),
}
#: the modes SparseLoCo's rule runs with (its residual is the codec's error feedback)
SPARSELOCO_MODES = ("blocking", "overlap", "delayed")


def outer_rule_names() -> tuple[str, ...]:
    """The outer optimizers' names, in ``OUTER_RULES`` order."""
    return tuple(OUTER_RULES)


@dataclass(frozen=True)
class OuterSpec:
    """An outer rule's settings; ``-1``: the sync mode's default."""

    optimizer: str = "nesterov"
    lr: float = -1.0
    momentum: float = -1.0
    alpha: float = -1.0  # merge factor local = alpha*local + (1-alpha)*global after a sync
    sparseloco_beta: float = 0.95
    co2_lr: float = 1.0
    co2_momentum: float = 0.0
    co2_penalty: str = "adaptive"
    co2_clip: float = 1.0
    residual_decay: float = 1.0

    def lr_for(self, mode: str) -> float:
        """The outer lr in force for a sync mode (not co2: ``co2_lr``; sparseloco: 1.0 by default)."""
        if self.lr >= 0:
            return self.lr
        return 1.0 if self.optimizer == "sparseloco" else _mode_default(mode)[0]

    def momentum_for(self, mode: str) -> float:
        """The outer momentum in force for a sync mode (not co2: ``co2_momentum``; sparseloco: none)."""
        if self.momentum >= 0:
            return self.momentum
        return 0.0 if self.optimizer == "sparseloco" else _mode_default(mode)[1]

    def alpha_for(self, mode: str) -> float:
        """The merge factor in force for a sync mode (0.5 in overlap, else 0, unless set)."""
        if self.alpha >= 0:
            return self.alpha
        return MODE_TRAITS[mode].default_alpha if mode in MODE_TRAITS else 0.0

    def problems(self, mode: str) -> list[str]:
        """What is wrong with these settings under sync mode ``mode``, one sentence each."""
        out: list[str] = []
        for check in _CHECKS:
            problem = check(self, mode)
            if problem:
                out.append(problem)
        return out

    def build(self, mode: str) -> Any:
        """The engine's outer-optimizer factory for sync mode ``mode`` (imports torch)."""
        from diloco.engine import outer

        if mode == "co2":
            penalty = self.co2_penalty if self.co2_penalty == "adaptive" else float(self.co2_penalty)
            return outer.co2(self.co2_lr, self.co2_momentum, self.co2_clip, penalty)
        if self.optimizer not in OUTER_RULES:
            raise ValueError(f"unknown outer optimizer {self.optimizer!r}; choose {', '.join(OUTER_RULES)}")
        if self.optimizer == "sparseloco" and self.momentum_for(mode):
            raise ValueError(f"sparseloco takes no outer momentum (its residual stands in for it), got {self.momentum}")
        return OUTER_RULES[self.optimizer](outer, self, mode)


def _mode_default(mode: str) -> tuple[float, float]:
    if mode == "co2":
        return CO2_DEFAULTS["lr"], CO2_DEFAULTS["momentum"]
    if mode not in MODE_DEFAULTS:
        raise ValueError(f"no outer-optimizer default for mode {mode!r}; modes: {', '.join([*MODE_DEFAULTS, 'co2'])}")
    return MODE_DEFAULTS[mode]


def by_name(name: str, lr: float, momentum: float, *, beta: float = 0.95) -> Any:
    """Factory for an outer optimizer of ``OUTER_RULES`` at this lr and momentum (``beta``: sparseloco's
    residual decay; it takes no momentum)."""
    return OuterSpec(optimizer=name, lr=lr, momentum=momentum, sparseloco_beta=beta).build("blocking")


def _lr(s: OuterSpec, mode: str) -> str | None:
    return None if s.lr == -1.0 or s.lr > 0 else f"--outer-lr must be > 0 (or -1 for the mode's default), got {s.lr}"


def _momentum(s: OuterSpec, mode: str) -> str | None:
    return None if s.momentum == -1.0 or 0.0 <= s.momentum < 1.0 else \
        f"--outer-momentum must be in [0, 1) (or -1 for the mode's default), got {s.momentum}"


def _alpha(s: OuterSpec, mode: str) -> str | None:
    return None if s.alpha == -1.0 or 0.0 <= s.alpha <= 1.0 else \
        f"--merge-alpha must be in [0, 1] (or -1 for the mode's default), got {s.alpha}"


def _co2(s: OuterSpec, mode: str) -> str | None:
    wrong = [f"--co2-lr must be > 0, got {s.co2_lr}"] if not s.co2_lr > 0 else []
    wrong += [f"--co2-momentum must be in [0, 1), got {s.co2_momentum}"] if not 0.0 <= s.co2_momentum < 1.0 else []
    wrong += [f"--co2-clip must be >= 0, got {s.co2_clip}"] if not s.co2_clip >= 0 else []
    return "\n  ".join(wrong) or None


def _sparseloco_beta(s: OuterSpec, mode: str) -> str | None:
    return None if 0.0 <= s.sparseloco_beta <= 1.0 else f"--sparseloco-beta must be in [0, 1], got {s.sparseloco_beta}"


def _residual_decay(s: OuterSpec, mode: str) -> str | None:
    wrong = [] if 0.0 <= s.residual_decay <= 1.0 else [f"--residual-decay must be in [0, 1], got {s.residual_decay}"]
    if s.residual_decay != 1.0 and s.optimizer == "sparseloco":
        wrong.append("--residual-decay with --outer-optimizer sparseloco: its residual's decay is --sparseloco-beta")
    return "\n  ".join(wrong) or None


def _sparseloco_momentum(s: OuterSpec, mode: str) -> str | None:
    if s.optimizer == "sparseloco" and s.momentum not in (-1.0, 0.0):
        return f"--outer-optimizer sparseloco takes no --outer-momentum (its residual stands in for it), got {s.momentum}"
    return None


def _sparseloco_mode(s: OuterSpec, mode: str) -> str | None:
    if s.optimizer == "sparseloco" and mode not in SPARSELOCO_MODES:
        return f"--outer-optimizer sparseloco runs with --mode {', '.join(SPARSELOCO_MODES[:-1])} or " \
               f"{SPARSELOCO_MODES[-1]}, not {mode}"
    return None


def _co2_penalty(s: OuterSpec, mode: str) -> str | None:
    if s.co2_penalty == "adaptive":
        return None
    try:
        ok = float(s.co2_penalty) >= 1.0
    except ValueError:
        ok = False
    return None if ok else f"--co2-penalty must be 'adaptive' or a number >= 1, got {s.co2_penalty!r}"


_CHECKS = (_lr, _momentum, _alpha, _co2, _sparseloco_beta, _residual_decay, _sparseloco_momentum, _sparseloco_mode,
           _co2_penalty)
