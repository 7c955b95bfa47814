"""Low-bandwidth local-update training (DiLoCo) across worker groups.

Public API: ``DiLoCo`` (the engine, every sync mode), ``connect`` (join a job: the averager for
real groups), ``Task``/``TaskContext`` (a user model for ``diloco run --entry``), schedules, outer
optimizer factories, ``partition`` (fragments), averagers. See docs/api.md. They are imported
lazily so that torch-free pieces (``diloco.coordinator``) start without loading torch.
"""

from importlib import import_module

_EXPORTS = {
    "DiLoCo": "diloco.engine", "NonFiniteError": "diloco.engine", "SyncEvent": "diloco.engine",
    "SyncResult": "diloco.engine", "MODES": "diloco.engine",
    "InitialParamsMismatch": "diloco.initial",
    "connect": "diloco.connection", "GroupConnection": "diloco.connection", "ConnectError": "diloco.connection",
    "Task": "diloco.task", "TaskContext": "diloco.task",
    "FixedSchedule": "diloco.schedule", "QSRSchedule": "diloco.schedule",
    "fixed_period": "diloco.schedule", "qsr_period": "diloco.schedule",
    "nesterov": "diloco.outer", "sgd": "diloco.outer", "co2": "diloco.outer", "CO2Outer": "diloco.outer",
    "StreamingDiLoCo": "diloco.streaming", "FragmentEvent": "diloco.streaming",
    "partition": "diloco.fragments", "gpt_fragments": "diloco.fragments",
    "DataParallelAcrossGroups": "diloco.data_parallel",
    "StripedAverager": "diloco.group",
    "InProcessGroups": "diloco.averaging", "SingleGroup": "diloco.averaging",
    "TransportConfig": "diloco.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
