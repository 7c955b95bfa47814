"""One rank's life under torchrun: ``worker`` starts it (device, process group, task, engine;
healing or resuming) and ``train_loop`` runs it; ``connection`` (``diloco.connect``) puts it into
the job through its ``endpoint`` and ``averager_setup`` (the averager, its bandwidth probes);
``data_feed``, ``group_parallel`` (DDP, FSDP2), ``device_placement``, ``cpu_threads``, ``kernels``,
``auto_setting`` (``--codec/--h auto``), ``tls_check`` and ``user_errors`` serve it. A new
parallelism inside a group is wired in ``group_parallel.py``. Imports ``checkpoints`` and ``ops``,
never ``launch``.
"""
