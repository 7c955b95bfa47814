"""Low-bandwidth local-update training (DiLoCo) across worker groups.

Public API: ``DiLoCo`` (the engine, every sync mode), ``connect`` (join a job: the averager for
real groups), ``Task``/``TaskContext`` (a user model for ``diloco run --entry``), schedules, outer
optimizer factories, ``partition`` (fragments), averagers. See docs/api.md. They are imported
lazily so that torch-free pieces (``diloco.coordinator``) start without loading torch.
"""

from importlib import import_module

_EXPORTS = {
    "DiLoCo": "diloco.engine.diloco", "NonFiniteError": "diloco.engine.diloco", "SyncEvent": "diloco.engine.diloco",
    "SyncResult": "diloco.engine.diloco", "MODES": "diloco.engine.diloco",
    "InitialParamsMismatch": "diloco.engine.initial",
    "connect": "diloco.runtime.rank.connection", "GroupConnection": "diloco.runtime.rank.connection",
    "ConnectError": "diloco.runtime.rank.endpoint",
    "Task": "diloco.job.task", "TaskContext": "diloco.job.task", "DataSource": "diloco.job.data_source",
    "FixedSchedule": "diloco.engine.schedule", "QSRSchedule": "diloco.engine.schedule",
    "PacedSchedule": "diloco.engine.schedule",
    "fixed_period": "diloco.engine.schedule", "qsr_period": "diloco.engine.schedule",
    "nesterov": "diloco.engine.outer", "sgd": "diloco.engine.outer", "co2": "diloco.engine.outer", "CO2Outer": "diloco.engine.outer",
    "sparseloco": "diloco.engine.outer", "SparseLoCo": "diloco.engine.outer",
    "StreamingDiLoCo": "diloco.engine.streaming", "FragmentEvent": "diloco.engine.streaming",
    "partition": "diloco.engine.fragments", "gpt_fragments": "diloco.engine.fragments",
    "DataParallelAcrossGroups": "diloco.engine.data_parallel",
    "StripedAverager": "diloco.exchange.striped",
    "InProcessGroups": "diloco.engine.averaging", "SingleGroup": "diloco.engine.averaging",
    "TransportConfig": "diloco.job.config",
    "shard_model": "diloco.job.fsdp",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
