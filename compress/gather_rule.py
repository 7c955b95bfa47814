"""How the groups' decoded contributions of an error-fed codec are combined (torch-free names).

An error-fed codec's exchange is an all-gather (``transport.gather``): every group decodes every
group's frame and reduces them the same way. Two averages exist, a codec option each (``topk``
only: ``--topk-mean``, ``--topk-clip-median``):

* ``MEAN_ALL`` (the default, and every other codec's): each index's sum over all G groups / G,
  SparseLoCo's paper notation ``(1/R) * sum_r Dhat_r``;
* ``MEAN_SENDERS``: each index's mean over the groups that sent it (a nonzero decoded value), as
  the SparseLoCo authors' code reduces the peers' top-k values
  (``scatter_reduce(reduce="mean", include_self=False)``); an index no group sent stays 0.

``clip_median``: before averaging, each group's decoded contribution is scaled down to the median
of the groups' norms when its norm is above it (the authors' production path, ``clip_norm=True``).
"""
from __future__ import annotations

MEAN_ALL = "all"
MEAN_SENDERS = "senders"
#: the averages, the default first
MEANS = (MEAN_ALL, MEAN_SENDERS)


def check_mean(mean: str) -> str | None:
    """The problem with an average's name, in one sentence, or None."""
    return None if mean in MEANS else f"must be one of {', '.join(MEANS)}, got {mean!r}"
