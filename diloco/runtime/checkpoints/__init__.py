"""A job's files on disk: ``checkpoint`` (the global model, atomic and pickle-free),
``job_checkpoint`` (every rank's whole state at one step; ``rank_state`` and ``local_shards`` say
what one rank saves) with ``checkpoint_index`` (what ``--resume`` finds, torch-free), and
``dcp_checkpoint`` (a group's shards with torch.distributed.checkpoint). Imports nothing else of
``runtime``.
"""
