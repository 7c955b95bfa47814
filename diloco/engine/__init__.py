"""The algorithm, free of processes and sockets: the DiLoCo engine (``diloco.py``), its fragments
(``fragment.py``) and sync modes (``sync_modes.py``), schedules, outer rules, error feedback, outer
state and the averager contract it syncs through (``averaging.py``).

A new outer rule goes in ``outer.py`` (named in ``outer_spec.OUTER_RULES``); a new sync mode in
``sync_modes.py`` (named in ``modes.py``); a new schedule in ``schedule.py`` (named in
``schedule_spec.SCHEDULES``); a new averager capability in ``averaging.py``. Nothing here imports the
rest of ``diloco``.
"""

from importlib import import_module

_EXPORTS = {
    "DiLoCo": "diloco.engine.diloco", "NonFiniteError": "diloco.engine.diloco",
    "SyncEvent": "diloco.engine.diloco", "SyncResult": "diloco.engine.diloco",
    "first_syncs": "diloco.engine.diloco", "MODES": "diloco.engine.modes",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # lazy, so that the torch-free ``modes`` loads without torch
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'diloco.engine' has no attribute {name!r}")
