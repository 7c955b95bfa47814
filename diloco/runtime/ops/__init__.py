"""What an operator reads and does: ``exit_codes`` (what a code says, which a restart fixes),
``logs`` and ``logpump`` (text or JSON records), ``metrics`` (Prometheus), ``status``
(``diloco status``), ``stack_dumps`` (``kill -USR1``) and ``processes`` (the process trees a run
started, found by their marker). The bottom of ``runtime``: imports nothing else of it.
"""
