"""The running job: ``worker`` (one rank under torchrun; a thin composition root), ``launcher``
(``diloco run``) with its ``supervise``-or, ``chaos`` drill and ``summary``, ``connection``
(``diloco.connect``: a rank joins a job), checkpoints, logs, metrics, status and GPU placement.
A new parallelism inside a group (DDP, FSDP) is wired in ``worker.py``.
"""
