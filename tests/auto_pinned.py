"""The auto table the choice tests script their links against: the study as it stood on 2026-11-27
(``diloco/job/auto_table.json`` at a070351), kept here so that those tests' expected rows (SparseLoCo
at 3 % then H=100 on a slow link, fp32 H=100 on a fast one) do not move each time the study adds rows
and the shipped table is regenerated (``python bench/auto_table.py``). Tests of the shipped table
itself (it reads, every setting builds, a job's config filters it) read ``auto_choice.TABLE_PATH``."""

from pathlib import Path

from diloco.job import auto_choice

PINNED_TABLE = Path(__file__).resolve().parent / "data" / "auto_table_pinned.json"


def pinned_table() -> auto_choice.AutoTable:
    """The pinned table (``auto_choice.load_table`` of ``PINNED_TABLE``)."""
    return auto_choice.load_table(PINNED_TABLE)


def shipped_best(codec: str, groups: int = 2) -> auto_choice.Setting:
    """What ``--codec CODEC --h auto`` runs on a link fast enough for every setting: ``auto_choice.choose``
    on the shipped table with a link and a step under which every setting fits (its lowest measured loss
    cost of that codec for ``groups`` groups; the test's job must be able to run it)."""
    return auto_choice.choose(auto_choice.load_table(), num_params=1, link_bytes_per_s=1e15, step_s=1.0,
                              groups=groups, codec=codec).setting
