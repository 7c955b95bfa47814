"""A resumable data source: a rank's batches whose position is a group-level sample counter.

Pass one as ``Task.train_batches`` and the job keeps every sample trained once across kills,
rollbacks, heals and resumes (``diloco.exchange.data_positions`` says what "once" means): the
group's committed position travels with the committed state, and a group that heals or whose
contribution was refused continues from it. The protocol::

    class MySource:
        samples_per_step: int           # samples the group's position advances per step:
                                        #   ranks in the group x samples in one rank's batch
        def __iter__(self): return self
        def __next__(self): ...         # this rank's next batch
        def state(self) -> dict: ...    # JSON-able, small; state()["samples"] is the position:
                                        #   samples the group consumed before the next batch
        def load_state(self, state: dict) -> None: ...   # continue there

The position is a *group* counter: at position ``p`` the group's next step takes samples
``[p, p + samples_per_step)``, rank ``r`` of ``R`` the slice ``[p + r*b, p + (r+1)*b)`` with
``b = samples_per_step // R`` (or any fixed split of them among the ranks). ``load_state`` must
accept ``{**state(), "samples": n}`` for any ``n`` a multiple of ``samples_per_step`` (that is how
the job seeks: ``seek``), so the batches must be a deterministic function of the position, e.g. of
(shard, seed, sample index) — ``diloco.demo.data.EpochSampler`` is one.

A plain iterator (any other ``train_batches``) cannot promise this: a healed group starts it from
the beginning (samples trained twice), a refused contribution's samples are not drawn again
(skipped), and a resume replays it by drawing and discarding batches.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class DataSourceError(ValueError):
    """A data source that does not keep the protocol (no position, a position that does not seek)."""


@runtime_checkable
class DataSource(Protocol):
    """See the module doc."""

    samples_per_step: int

    def __iter__(self) -> Any: ...

    def __next__(self) -> Any: ...

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


def is_data_source(obj: Any) -> bool:
    """Whether ``obj`` keeps the ``DataSource`` protocol (has its methods and ``samples_per_step``)."""
    return isinstance(obj, DataSource)


def position(source: DataSource) -> int:
    """The group position of ``source`` in samples; DataSourceError if its state has none."""
    samples = source.state().get("samples")
    if type(samples) is not int or samples < 0:
        raise DataSourceError(f"{type(source).__name__}.state() must hold 'samples' (an int >= 0), got {samples!r}")
    return samples


def seek(source: DataSource, samples: int) -> None:
    """Continue ``source`` at group position ``samples``; DataSourceError unless it lands there."""
    step = int(source.samples_per_step)
    if step <= 0 or samples < 0 or samples % step:
        raise DataSourceError(f"cannot seek {type(source).__name__} to sample {samples}: positions are "
                              f"multiples of samples_per_step={step} >= 0")
    source.load_state({**source.state(), "samples": samples})
    if position(source) != samples:
        raise DataSourceError(f"{type(source).__name__}.load_state was asked for sample {samples} and went to "
                              f"{position(source)}")
