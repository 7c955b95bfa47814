"""Error feedback across groups: each group's residual of what its compressed Δ did not deliver.

With a biased codec (``sign1``, ``topk``) every group keeps, per fragment, a residual ``e`` (fp32,
the fragment's length, on the global copy's device) and sends ``y = Δ + e`` instead of Δ::

    y = Δ + β·e;   send C(y);   e ← y − decode(C(y))      (β = 1, or --residual-decay; SparseLoCo's rule: 0.95)

so over any number of rounds everything the other groups decoded of this group, plus ``e``, is
the sum of its Δs: nothing a round drops is lost, it is sent later (docs/algorithms.md §8.2). The
averager must carry each group's own encoded ``y`` to every group (``all_gather_mean``, not the
ring all-reduce, which re-encodes partial sums) and say what they decoded of it: its pending
result's ``sent``.

The residual changes only when an exchange lands (``wait`` returned the committed mean), from that
exchange's ``sent``: an attempt that was rolled back and retried never touches it, and an
exchange that refused this group's contribution (``own_rejected``: NaN/Inf or an outlier, the
engine then resets the fragment's local state) leaves it as it was. Every rank of a group holds
the whole residual, the same bits on every rank (the averager shares each rank's stripes of
``sent`` in the group), so a new stripe plan (other bandwidths, another quorum) needs no transfer
and every rank's checkpoint holds the group's residual. A group that heals into a running job
starts with a zero residual: the donor's is the donor's own, which the donor still sends.
"""

from __future__ import annotations

from typing import Any

import torch

from diloco.engine.averaging import PendingMean


class Residuals:
    """The error-feedback residual of each of ``num_fragments`` fragments of one group.
    ``decay``: β of SparseLoCo, ``y = Δ + β·e`` (1: plain error feedback)."""

    def __init__(self, num_fragments: int, decay: float = 1.0) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"the residual's decay must be in [0, 1], got {decay}")
        self.residual: list[torch.Tensor | None] = [None] * num_fragments  # None: zero
        self.decay = decay

    def start(self, averager: Any, p: int, delta: torch.Tensor, *, tag: str, **kwargs: Any) -> "Landing":
        """Launch fragment p's exchange of ``delta + decay * residual`` (``delta`` is not changed);
        the residual is updated when the returned pending result is first waited for."""
        e = self.residual[p]
        y = delta.detach().to(torch.float32).clone() if e is None else delta.detach().to(torch.float32) + (
            e if self.decay == 1.0 else self.decay * e)
        pending = averager.start(y, tag=tag, error_feedback=True, **kwargs)
        return Landing(self, p, y, pending)

    def land(self, p: int, y: torch.Tensor, sent: torch.Tensor) -> None:
        """Fragment p's exchange of ``y`` landed and the others decoded ``sent`` of it:
        ``e ← y − sent`` (``y`` becomes the residual)."""
        if sent is None or sent.shape != y.shape:
            raise RuntimeError(f"fragment {p}: the averager did not say what the other groups decoded of this "
                               "group's contribution (no error feedback without it)")
        self.residual[p] = y.sub_(sent.to(y.device))

    def state_of(self, p: int) -> torch.Tensor | None:
        """Fragment p's residual (a copy; None: zero), for a checkpoint."""
        e = self.residual[p]
        return None if e is None else e.detach().clone()

    def load(self, p: int, saved: torch.Tensor | None, numel: int, device: torch.device | str) -> None:
        """Restore fragment p's residual (None: zero): ``numel`` fp32 values, put on ``device``."""
        if saved is None:
            self.residual[p] = None
            return
        if not isinstance(saved, torch.Tensor) or saved.dtype != torch.float32 or saved.dim() != 1 \
                or saved.numel() != numel:
            raise ValueError(f"fragment {p}: residual of {getattr(saved, 'dtype', type(saved))} "
                             f"{tuple(getattr(saved, 'shape', ()))}, want float32 ({numel},)")
        self.residual[p] = saved.detach().to(device).clone()

    def take(self, p: int) -> torch.Tensor | None:
        """Fragment p's residual, which it no longer keeps (None: zero), as the next exchange would
        have sent it (``decay · e``): error feedback stopped (``DiLoCo.set_error_feedback``) and
        the residual is sent once, in its next Δ."""
        e, self.residual[p] = self.residual[p], None
        return e if e is None or self.decay == 1.0 else self.decay * e

    def reset(self) -> None:
        """Forget every residual (a group healed from another group's state)."""
        self.residual = [None] * len(self.residual)


class Landing:
    """A pending exchange whose first ``wait`` also updates the fragment's residual."""

    def __init__(self, residuals: Residuals, p: int, y: torch.Tensor, pending: PendingMean) -> None:
        self._residuals, self._p, self._y, self._pending = residuals, p, y, pending
        self._landed = False

    @property
    def own_rejected(self) -> bool:
        """The quorum refused this group's contribution (it then sent zeros)."""
        return bool(getattr(self._pending, "own_rejected", False))

    def wait(self) -> torch.Tensor:
        mean = self._pending.wait()
        if not self._landed:
            self._landed = True
            if not self.own_rejected:  # a refused Δ (NaN, outlier) must not enter the residual
                self._residuals.land(self._p, self._y, getattr(self._pending, "sent", None))
            self._y = None  # type: ignore[assignment]
        return mean
