"""The running job, by concern, one way down (``launch → rank → checkpoints, ops``):

- ``rank/``: one rank's life under torchrun: ``worker`` (a thin composition root), the training
  loop, ``connection`` (``diloco.connect``: a rank joins a job), its endpoint and credentials, data
  feed, parallelism inside the group, device and CPU threads, kernels, ``--codec/--h auto``.
- ``launch/``: ``diloco run`` on one machine: the launcher, its supervisor, ``diloco torchrun``'s
  agent, warm spares, the chaos drill and its relays, preflight checks, the run lock, the summary.
- ``checkpoints/``: files of a job: global-model checkpoints, job checkpoints (one rank's state,
  sharded parts, the index ``--resume`` reads), DCP checkpoints.
- ``ops/``: what an operator reads: exit codes, logs, Prometheus metrics, ``diloco status``, stack
  dumps, the process trees a run started.
"""
