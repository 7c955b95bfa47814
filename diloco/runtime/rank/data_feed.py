"""A rank's batches, drawn so that its group trains every sample once (``diloco.exchange.data_positions``).

The training loop takes its batches from a ``DataFeed``: with a resumable data source
(``diloco.job.data_source``) the feed continues at the group's committed position after a heal,
seeks back to it after the quorum refused this group's contribution, and restores the table of
committed positions from a checkpoint. With a plain iterator it only draws (what it cannot
promise: ``diloco.job.task.Task``).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from diloco.exchange.data_positions import DataPositions
from diloco.job.data_source import DataSourceError, is_data_source, position, seek

log = logging.getLogger(__name__)


class DataFeed:
    """This rank's batches from ``train_batches``; ``positions``: its averager's table (None when
    the job has no quorums, e.g. a single group without a coordinator)."""

    def __init__(self, train_batches: Any, positions: DataPositions | None, *, group: int = 0,
                 rank: int = 0) -> None:
        self.source = train_batches if is_data_source(train_batches) else None
        self.batches = iter(train_batches)
        self.positions, self.group, self.rank = positions, group, rank
        if self.source is not None:
            step = int(self.source.samples_per_step)
            if step <= 0:
                raise DataSourceError(f"{type(self.source).__name__}.samples_per_step must be > 0, got {step}")
            if positions is not None:
                positions.samples_per_step = step

    def healed(self) -> None:
        """The group joined a running job: continue at its committed position (a plain iterator
        starts afresh, and says so)."""
        if self.positions is None:
            return
        if self.source is None:
            log.warning("group %d: healed with a plain train_batches iterator, which cannot go back to the group's "
                        "committed position (a new process starts it again from its first batch, a heal in place "
                        "goes on from where it was: samples trained twice or skipped); a "
                        "diloco.job.data_source.DataSource continues at the group's committed position", self.group)
            return
        seek(self.source, self.positions.committed_samples())
        if self.rank == 0:  # rank 0 keeps the group's ledger
            self.positions.log_inherited()
        log.info("group %d rank %d: data continues at the group's committed sample %d", self.group, self.rank,
                 position(self.source))

    def resumed(self, state: Mapping[str, Any]) -> None:
        """After a checkpoint's data position was restored: take its table of committed positions."""
        if self.positions is None:
            return
        if state.get("data_positions") is None:  # a checkpoint of a version before the table
            log.warning("group %d: the checkpoint holds no table of committed data positions (an older "
                        "version); the group's committed position (its ledger, a refused round's redraw) "
                        "counts from 0 at this resume", self.group)
            return
        self.positions.load_state(state["data_positions"])
        if self.rank == 0:  # rank 0 keeps the group's ledger: commits after the checkpoint were lost
            self.positions.log_resumed()

    def next(self) -> Any:
        """This rank's next batch (StopIteration when a plain iterator ran out)."""
        return next(self.batches)

    def after_step(self) -> None:
        """After the engine's step: if the quorum refused this group's contribution, draw its
        samples again from the committed position."""
        if self.positions is None or not self.positions.take_refused():
            return
        if self.source is None:
            log.warning("group %d: its contribution was refused; a plain train_batches iterator cannot draw the "
                        "refused round's samples again (they are skipped)", self.group)
            return
        seek(self.source, self.positions.committed_samples())
        log.info("group %d rank %d: contribution refused or left out by the grace window; data goes back to the committed sample %d", self.group,
                 self.rank, position(self.source))
