"""What a job is, before anything runs: its configuration (``config``: sections, defaults,
validation; ``config_parse``: files and flags) and what it trains (``task``: ``Task``,
``TaskContext``, ``--entry`` loading). A new option goes in ``config.py``; a new workload is a
``Task`` entry of its own (``diloco.demo`` is one).
"""
