"""``diloco run`` on one machine: ``launcher`` starts a coordinator and one ``diloco torchrun``
(``agent``) per group, ``supervise`` restarts failed groups (``spare``: warm spares), ``chaos`` and
``link_relays`` drill faults, ``preflight`` and ``run_lock`` check before anything starts,
``summary`` prints the end. The top of ``runtime``: imports ``rank``, ``checkpoints`` and ``ops``.
"""
