"""Averagers: how one group's pseudo-gradient is averaged with the other groups'.

An averager takes this group's flat fp32 pseudo-gradient and returns the mean over all groups,
bit-identical on every group. ``start(flat, tag=...)`` launches the exchange and returns at once;
``.wait()`` on the result blocks for the mean, so inner steps can run while it travels.
``all_reduce_mean`` is the blocking form.

The contract is written here: ``Averager`` (what every averager has), and optional capabilities,
each a ``runtime_checkable`` Protocol the engine checks with ``isinstance`` before it uses their
members: ``Weighted``, ``Screening``, ``ShardExchanging``, ``ErrorFed``, ``Coded``/``CodecSwitching``,
``StreamsFinal``, ``Healing``, ``Observing``; a pending result may say ``Refusable``, ``Shared``,
``Gathered``, ``Attempted``. The
engine uses no other member of an averager (``tests/engine/test_averager_contract.py``).

``SingleGroup`` is the trivial averager; ``InProcessGroups`` simulates several groups as threads of
one process (tests, quick experiments); the cross-datacenter one, over the ``transport`` package,
is ``diloco.exchange.striped.StripedAverager``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


class PendingMean(Protocol):
    """An exchange in flight (``Averager.start``'s result)."""

    def wait(self) -> torch.Tensor:
        """Block until the mean is known; returns it (1-D fp32)."""
        ...


class Averager(Protocol):
    """What every averager offers the engine. The optional capabilities below add members; the
    engine uses a member only where the averager declares its capability (``isinstance``)."""

    num_groups: int  # groups taking part
    group_index: int  # this group's position among them, 0..num_groups-1

    def start(self, flat: torch.Tensor, *, tag: str, exact: bool = False) -> PendingMean:
        """Launch the mean of ``flat`` over all groups; ``tag`` names this exchange uniquely.
        ``flat`` stays the caller's: it is intact until the pending mean is waited for, and may be
        written after (the engine writes a fragment's next Δ into the same vector): copy what is
        kept longer. ``exact``: send fp32 whatever the configured codec (for control exchanges). Capabilities
        add keywords: ``weight=`` (``Weighted``), ``error_feedback=`` (``ErrorFed``), ``shards=``
        (``ShardExchanging``)."""
        ...

    def all_reduce_mean(self, flat: torch.Tensor, *, round: int) -> torch.Tensor:
        """Blocking mean of ``flat`` (1-D fp32) over all groups; does not modify ``flat``."""
        ...


# --- optional capabilities of an averager ---------------------------------------------------


@runtime_checkable
class Weighted(Protocol):
    """When ``weighted``: ``start`` takes ``weight=`` (the contribution's inner steps) and the
    mean is weighted by it."""

    weighted: bool


@runtime_checkable
class Screening(Protocol):
    """When ``screens_contributions``: a NaN/Inf contribution is refused by the averager (its
    pending result says ``own_rejected``) instead of by the engine before it is sent."""

    screens_contributions: bool


@runtime_checkable
class ShardExchanging(Protocol):
    """When ``exchanges_shards``: ``start`` takes ``shards=`` (a
    ``diloco.engine.shard_layout.ShardLayout``): ``flat`` is then this rank's shard of a sharded
    model's fragment, laid out so, and the mean is of that shard, exchanged with the ranks of the
    other groups that hold the same elements."""

    exchanges_shards: bool


@runtime_checkable
class ErrorFed(Protocol):
    """When ``error_feedback`` (its codec needs one: int2, sign1, topk): ``start`` takes
    ``error_feedback=True`` from a caller that keeps the residual, and its pending result says
    what the other groups decoded of the contribution (``Gathered``)."""

    error_feedback: bool


@runtime_checkable
class Coded(Protocol):
    """Runs a ``compress`` codec (``codec``: the one of its next exchange)."""

    codec: Any


@runtime_checkable
class CodecSwitching(Coded, Protocol):
    """Can switch codecs between exchanges (``--final-codec``, ``--codec auto``)."""

    def set_codec(self, codec: Any) -> None:
        """Run ``codec`` from the next ``start`` on (every group at the same exchange)."""
        ...


@runtime_checkable
class Healing(Protocol):
    """Fault tolerant: a group that joins a running job heals from a live one's state."""

    def attach(self, engine: Any) -> bool:
        """Called as the engine is built; True: call ``heal(engine)`` instead of agreeing on the
        initial parameters."""
        ...

    def heal(self, engine: Any) -> None:
        """Load a live member's engine state into ``engine`` and join its exchange (``adopt``)."""
        ...


class FinalRanges(Protocol):
    """A callback told ``(attempt, mean, lo, hi)`` from the averager's threads as ``mean[lo:hi]``
    becomes final in attempt ``attempt`` (1, 2, ...: a rolled-back attempt's ranges are
    superseded by the next one's); each range once per attempt, not necessarily all of them, and
    every range of an attempt before any of the next one's."""

    def __call__(self, attempt: int, mean: torch.Tensor, lo: int, hi: int) -> None: ...


@runtime_checkable
class WritesInto(Protocol):
    """When ``writes_into``: ``start`` takes ``out=`` (a vector shaped like ``flat``, on its
    device) and, when the exchange commits at its first attempt, returns the mean in ``out``
    itself, which nothing writes after ``wait``; any other result comes in a vector of its own,
    and ``out`` may still be written by an abandoned attempt's threads: the caller drops it. (The
    engine passes a vector it keeps from round to round: a fresh one costs a page fault per 4 KiB.)"""

    writes_into: bool


@runtime_checkable
class StreamsFinal(Protocol):
    """When ``streams_final``: ``start`` takes ``on_final=`` (a ``FinalRanges``), and the pending
    result says which attempt committed (``Attempted``): the engine steps those ranges while the
    rest of the mean is on the wire (``diloco.engine.streamed_outer``)."""

    streams_final: bool


@runtime_checkable
class Observing(Protocol):
    """Told after every engine step and ``close()`` what happened (metrics, round hashes)."""

    def observe(self, engine: Any, events: list) -> None:
        ...


# --- optional facts of a pending result -----------------------------------------------------


@runtime_checkable
class Refusable(Protocol):
    """``own_rejected``: the quorum refused this group's contribution (NaN/Inf or an outlier)."""

    own_rejected: bool


@runtime_checkable
class Shared(Protocol):
    """``own_share`` (after ``wait``): this group's share of the committed weighted mean (None:
    1 / num_groups, an unweighted mean)."""

    own_share: float | None


@runtime_checkable
class Gathered(Protocol):
    """``sent`` (after ``wait``): what the other groups decoded of this group's contribution."""

    sent: torch.Tensor | None


@runtime_checkable
class Attempted(Protocol):
    """``final_attempt`` (after ``wait``): the attempt whose ranges ``on_final`` reported the
    committed mean of (None: none of them)."""

    final_attempt: int | None


@dataclass(frozen=True)
class Capabilities:
    """The boolean capabilities an averager declares, as they are when read (``of``); an
    undeclared one is False."""

    weighted: bool = False
    screens_contributions: bool = False
    exchanges_shards: bool = False
    error_feedback: bool = False
    streams_final: bool = False
    writes_into: bool = False

    @classmethod
    def of(cls, averager: object) -> "Capabilities":
        return cls(weighted=isinstance(averager, Weighted) and bool(averager.weighted),
                   screens_contributions=isinstance(averager, Screening) and bool(averager.screens_contributions),
                   exchanges_shards=isinstance(averager, ShardExchanging) and bool(averager.exchanges_shards),
                   error_feedback=isinstance(averager, ErrorFed) and bool(averager.error_feedback),
                   streams_final=isinstance(averager, StreamsFinal) and bool(averager.streams_final),
                   writes_into=isinstance(averager, WritesInto) and bool(averager.writes_into))


def writable(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Where an exchange like ``like`` writes its mean (``WritesInto``): ``out`` when given, else a
    vector of its own. ValueError when ``out`` cannot hold it."""
    if out is None:
        return torch.empty_like(like)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"out= must be a contiguous {like.dtype} vector of {like.numel()} values on {like.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def refused(pending: PendingMean) -> bool:
    """Whether the quorum refused this group's contribution to ``pending`` (``Refusable``)."""
    return isinstance(pending, Refusable) and bool(pending.own_rejected)


def share_of(pending: PendingMean) -> float | None:
    """This group's share of ``pending``'s committed mean (``Shared``); None: not said."""
    return pending.own_share if isinstance(pending, Shared) else None


def final_attempt(pending: PendingMean) -> int | None:
    """The attempt of ``pending`` whose final ranges were reported (``Attempted``); None: none."""
    return pending.final_attempt if isinstance(pending, Attempted) else None


def decoded(pending: PendingMean) -> torch.Tensor | None:
    """What the other groups decoded of this group's contribution (``Gathered``); None: not said."""
    return pending.sent if isinstance(pending, Gathered) else None


class Done:
    """A mean that is already known, with what its exchange said of this group's part in it
    (``Refusable``, ``Shared``, ``Attempted``; the defaults: nothing said)."""

    def __init__(self, value: torch.Tensor, *, own_rejected: bool = False, own_share: float | None = None,
                 final_attempt: int | None = None) -> None:
        self.value = value
        self.own_rejected, self.own_share, self.final_attempt = own_rejected, own_share, final_attempt

    @classmethod
    def of(cls, pending: PendingMean) -> "Done":
        """``pending``'s mean (waited for) with its facts, to keep after the exchange is gone."""
        return cls(pending.wait(), own_rejected=refused(pending), own_share=share_of(pending),
                   final_attempt=final_attempt(pending))

    def facts(self) -> dict:
        """The facts as plain values (a checkpoint's)."""
        return {"own_rejected": self.own_rejected, "own_share": self.own_share, "final_attempt": self.final_attempt}

    def wait(self) -> torch.Tensor:
        return self.value


class SingleGroup:
    """One group: the mean is the input itself (copied). Works for a sharded model as well."""

    num_groups = 1
    group_index = 0
    bytes_sent = 0
    exchanges_shards = True  # each rank's mean of its shard is its shard

    def start(self, flat: torch.Tensor, *, tag: str, exact: bool = False, shards: object = None) -> PendingMean:
        return Done(flat.detach().clone())

    def all_reduce_mean(self, flat: torch.Tensor, *, round: int) -> torch.Tensor:
        return self.start(flat, tag=f"r{round}").wait()


class InProcessGroups:
    """``size`` simulated groups in one process; member ``i`` is used from thread ``i``.

    Contributions are matched by tag. Every member sums them in group order and divides by
    ``size``, so all members get bit-identical results, as the real ring guarantees.
    ``codec``: a ``compress`` codec each member's contribution goes through (encoded once, as a
    whole; exact exchanges skip it); one that needs error feedback makes the members require
    ``error_feedback=True`` and report ``sent``, as ``StripedAverager`` does. ``weighted``: the
    members take each contribution's ``weight`` (the engine passes its inner steps) and the mean
    is ``sum(w_i x_i) / sum(w_i)``, as a quorum's is; ``weights[tag]`` keeps them, by member.
    """

    def __init__(self, size: int, timeout_s: float = 60.0, codec=None, weighted: bool = False) -> None:
        self.size = size
        self.weighted = weighted
        self.weights: dict[str, list[float]] = {}
        self.timeout_s = timeout_s
        self.codec = codec
        self.error_feedback = bool(getattr(codec, "requires_error_feedback", False))
        self._cond = threading.Condition()
        self._slots: dict[str, dict[int, torch.Tensor]] = {}
        self._taken: dict[str, int] = {}

    def member(self, index: int) -> "InProcessMember":
        return InProcessMember(self, index)

    def _post(self, tag: str, index: int, flat: torch.Tensor, weight: float | None = None) -> None:
        with self._cond:
            slot = self._slots.setdefault(tag, {})
            if index in slot:
                raise RuntimeError(f"member {index} posted tag {tag!r} twice")
            slot[index] = flat.detach().clone()
            if weight is not None:
                self.weights.setdefault(tag, [0.0] * self.size)[index] = weight
            self._cond.notify_all()

    def _mean(self, tag: str) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._slots.get(tag, {})) == self.size, self.timeout_s):
                raise TimeoutError(f"in-process all-reduce {tag!r}: not every group contributed")
            slot = self._slots[tag]
            w = self.weights.get(tag)
            total = torch.zeros_like(slot[0])
            for i in range(self.size):
                total += slot[i] if w is None else w[i] * slot[i]
            self._taken[tag] = self._taken.get(tag, 0) + 1
            if self._taken[tag] == self.size:
                del self._slots[tag], self._taken[tag]
            if w is None:
                return total / self.size
            if sum(w) <= 0:
                raise ValueError(f"in-process weighted mean {tag!r}: every weight is 0")
            return total / sum(w)


class _InProcessPending:
    def __init__(self, groups: InProcessGroups, tag: str, sent: torch.Tensor | None = None) -> None:
        self._groups, self._tag, self._value = groups, tag, None
        self.sent = sent  # what the other members decoded of this member's contribution (codec only)

    def wait(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._groups._mean(self._tag)
        return self._value


class InProcessMember:
    def __init__(self, groups: InProcessGroups, index: int) -> None:
        self._groups = groups
        self.index = index
        self.group_index = index
        self.num_groups = groups.size
        self.codec = groups.codec

    @property
    def error_feedback(self) -> bool:
        return bool(getattr(self.codec, "requires_error_feedback", False))

    def set_codec(self, codec) -> None:
        """This member's codec from its next ``start`` on (every member must switch at the same tag)."""
        self.codec = codec

    @property
    def weighted(self) -> bool:
        return self._groups.weighted

    def start(self, flat: torch.Tensor, *, tag: str, exact: bool = False, error_feedback: bool = False,
              weight: float = 1.0) -> PendingMean:
        """Post this member's contribution under ``tag``; ``weight`` counts only when weighted
        (exact exchanges are plain means)."""
        codec = self.codec
        w = float(weight) if self._groups.weighted and not exact else None
        if w is not None and not (w >= 0 and w < float("inf")):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        if codec is None or exact:
            self._groups._post(tag, self.index, flat, w)
            return _InProcessPending(self._groups, tag)
        if self.error_feedback and not error_feedback:
            raise ValueError(f"codec {codec.name!r} needs error feedback: pass error_feedback=True and keep the residual")
        sent = codec.encode_with_decoded(flat.detach().to(torch.float32).contiguous())[1]
        self._groups._post(tag, self.index, sent, w)
        return _InProcessPending(self._groups, tag, sent)

    def all_reduce_mean(self, flat: torch.Tensor, *, round: int) -> torch.Tensor:
        return self.start(flat, tag=f"r{round}").wait()
