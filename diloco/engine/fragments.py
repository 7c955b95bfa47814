"""Partition a model's trainable parameters into P fragments for Streaming DiLoCo.

``partition(model, P, ...)`` returns P lists of parameter names (as ``named_parameters`` spells
them); each fragment is synced on its own schedule. Sizes are counted in elements
(``numel``), not bytes. Frozen parameters (``requires_grad=False``) are left out, and tied
parameters appear once, under their first name (``named_parameters`` de-duplicates them).
Within a fragment names keep ``named_parameters`` order. ``P=1`` returns every name. Pick one
rule:

**Default** (no ``blocks``, ``block_pattern`` or ``groups``): works on any ``nn.Module``. The
units are the model's top-level children plus the root's own parameters. Units are assigned
largest first to the fragment that holds the fewest elements so far. While there are fewer units
than fragments, or the largest fragment would exceed ``(1 + tolerance) * total / P`` elements,
the largest unit that can be split is replaced by its children (a leaf module splits into its
single parameters, the finest units) and the assignment is redone. ``tolerance`` defaults to
0.25; if even single parameters cannot meet it, ``ValueError`` names the largest parameter and
asks for fewer fragments or a larger ``tolerance``. Fragments are ordered by their first
parameter.

**Repeated blocks**: ``blocks="transformer.h"`` (dotted path of a ``ModuleList``/``Sequential``)
or ``block_pattern=r"layers\\.(\\d+)\\."`` (a regex whose first group is the block key; numeric
keys sort numerically). Blocks go to fragments by ``pattern``:

* ``"strided"`` (default): block i goes to fragment i mod P (interleaves depth; the Streaming
  DiLoCo paper's better-behaved pattern);
* ``"sequential"``: P contiguous runs of blocks.

**Explicit groups**: ``groups=[["encoder"], ["decoder", "head"]]``, one list of name prefixes
per fragment. A prefix matches on dotted boundaries: ``"encoder"`` matches ``encoder`` and
``encoder.0.weight`` but ``"enc"`` matches neither. A prefix that matches nothing, or a
parameter matched by two groups, is an error.

Parameters outside the blocks or groups (embeddings, head, final norm) follow ``rest``:

* ``"balance"`` (default): each one joins the fragment that holds the fewest elements so far,
  largest first, so every fragment stays close to 1/P of the model and P is what was asked;
* ``"own"``: they form one more fragment of their own, synced like the others (MaxText's choice),
  so there are P + 1 fragments.

``pattern`` belongs to a block rule and ``rest`` to a block or group rule; either given without
its rule is an error (the default rule places every parameter itself).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch.nn as nn

Pattern = Literal["strided", "sequential"]
Rest = Literal["balance", "own"]

_SHOWN = 8


@dataclass(frozen=True)
class _Unit:
    """A set of parameter names that the default rule keeps together."""

    path: str
    names: tuple[str, ...]
    size: int
    module: nn.Module | None  # None: a single parameter, which cannot be split further


# --- messages -------------------------------------------------------------------------------


def _listing(items: Sequence[str]) -> str:
    if not items:
        return "none"
    more = f", ... ({len(items)} in all)" if len(items) > _SHOWN else ""
    return ", ".join(repr(s) for s in items[:_SHOWN]) + more


def _top_level_names(model: nn.Module) -> list[str]:
    """Top-level children and root parameters that hold trainable parameters."""
    trainable = (n for n, p in model.named_parameters() if p.requires_grad)
    return list(dict.fromkeys(n.split(".", 1)[0] for n in trainable))


def _block_lists(model: nn.Module) -> list[str]:
    """Outermost ModuleList/Sequential paths below the root."""
    found: list[str] = []
    for n, m in model.named_modules():
        if n and isinstance(m, (nn.ModuleList, nn.Sequential)) and not any(_under(n, f) for f in found):
            found.append(n)
    return found


def _instead(model: nn.Module) -> str:
    return (
        f"The model's top-level names are {_listing(_top_level_names(model))}; "
        f"its ModuleList/Sequential paths (for blocks=) are {_listing(_block_lists(model))}. "
        "Omit blocks, block_pattern and groups to split by top-level children, balanced by size."
    )


# --- the block rules (blocks=, block_pattern=) ------------------------------------------------


def _resolve_blocks(model: nn.Module, blocks: str) -> nn.ModuleList | nn.Sequential:
    module: nn.Module = model
    for part in blocks.split("."):
        if not hasattr(module, part):
            raise ValueError(f"model has no submodule {blocks!r} (missing {part!r}). {_instead(model)}")
        module = getattr(module, part)
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        raise ValueError(
            f"blocks={blocks!r} is a {type(module).__name__}, not a ModuleList/Sequential of blocks. "
            f"{_instead(model)}"
        )
    return module


def _block_keys_from_modules(model: nn.Module, blocks: str) -> dict[str, int]:
    owner: dict[int, int] = {}
    for i, block in enumerate(_resolve_blocks(model, blocks)):
        for p in block.parameters():
            owner.setdefault(id(p), i)
    return {name: owner[id(p)] for name, p in model.named_parameters() if id(p) in owner}


def _compile(block_pattern: str, model: nn.Module) -> re.Pattern[str]:
    example = r'block_pattern=r"layers\.(\d+)\."'
    try:
        regex = re.compile(block_pattern)
    except re.error as e:
        raise ValueError(f"block_pattern {block_pattern!r} is not a valid regex ({e}); e.g. {example}") from e
    if regex.groups < 1:
        raise ValueError(
            f"block_pattern {block_pattern!r} needs a group that captures the block key, e.g. {example}. "
            f"{_instead(model)}"
        )
    return regex


def _block_keys_from_pattern(model: nn.Module, block_pattern: str) -> dict[str, int]:
    regex = _compile(block_pattern, model)
    found: dict[str, str] = {}
    for name, _ in model.named_parameters():
        m = regex.search(name)
        if m:
            found[name] = m.group(1)
    if not found:
        names = [n for n, _ in model.named_parameters()]
        raise ValueError(
            f"block_pattern {block_pattern!r} matches no parameter name (names look like {_listing(names[:3])}). "
            f"{_instead(model)}"
        )
    order = sorted(set(found.values()), key=lambda k: (len(k), k) if k.isdigit() else (0, k))
    index = {k: i for i, k in enumerate(order)}
    return {name: index[k] for name, k in found.items()}


def assign_blocks(num_blocks: int, num_fragments: int, pattern: Pattern) -> list[int]:
    """Fragment index of each block (pure)."""
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if num_blocks < num_fragments:
        raise ValueError(f"{num_blocks} blocks cannot fill {num_fragments} fragments")
    if pattern == "strided":
        return [i % num_fragments for i in range(num_blocks)]
    if pattern == "sequential":
        return [i * num_fragments // num_blocks for i in range(num_blocks)]
    raise ValueError(f"unknown fragment pattern {pattern!r}; choose strided or sequential")


def _by_blocks(
    keys: Mapping[str, int], names: Sequence[str], num_fragments: int, pattern: Pattern
) -> list[list[str]]:
    where = assign_blocks(max(keys.values(), default=-1) + 1, num_fragments, pattern)
    frags: list[list[str]] = [[] for _ in range(num_fragments)]
    for n in names:
        if n in keys:
            frags[where[keys[n]]].append(n)
    return frags


# --- explicit groups -------------------------------------------------------------------------


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _by_groups(model: nn.Module, names: Sequence[str], groups: Sequence[Sequence[str]]) -> list[list[str]]:
    owner: dict[str, int] = {}
    for g, prefixes in enumerate(groups):
        if isinstance(prefixes, str) or not prefixes:
            raise ValueError(f"groups[{g}] must be a non-empty list of name prefixes, got {prefixes!r}")
        for prefix in prefixes:
            hits = [n for n in names if _under(n, prefix)]
            if not hits:
                raise ValueError(
                    f"groups[{g}] prefix {prefix!r} matches no trainable parameter (prefixes match whole "
                    f"dotted names; tied parameters go by their first name). Valid top-level names: "
                    f"{_listing(_top_level_names(model))}"
                )
            for n in hits:
                if owner.setdefault(n, g) != g:
                    raise ValueError(
                        f"parameter {n!r} is matched by groups[{owner[n]}] and groups[{g}] (prefix {prefix!r}); "
                        "each parameter may belong to one group"
                    )
    return [[n for n in names if owner.get(n) == g] for g in range(len(groups))]


# --- parameters outside the blocks or groups -------------------------------------------------


def _place_rest(frags: list[list[str]], sizes: Mapping[str, int], rest: Rest) -> list[list[str]]:
    placed = {n for f in frags for n in f}
    others = [n for n in sizes if n not in placed]
    if rest == "own":
        return frags + [others] if others else frags
    loads = [sum(sizes[n] for n in f) for f in frags]
    for n in sorted(others, key=lambda n: -sizes[n]):
        f = min(range(len(frags)), key=loads.__getitem__)
        frags[f].append(n)
        loads[f] += sizes[n]
    return frags


# --- the default rule: top-level children, expanded until balanced ----------------------------


def _subunits(path: str, module: nn.Module, names: Sequence[str], sizes: Mapping[str, int]) -> list[_Unit]:
    """Split ``module`` (at ``path``, holding ``names``) into its own parameters and its children."""
    cut = len(path) + 1 if path else 0
    members: dict[str, list[str]] = {}
    for n in names:
        members.setdefault(n[cut:].split(".", 1)[0], []).append(n)
    units = []
    for head, group in members.items():
        sub = f"{path}.{head}" if path else head
        is_param = group == [sub]
        child = None if is_param else module.get_submodule(head)
        units.append(_Unit(sub, tuple(group), sum(sizes[n] for n in group), child))
    return units


def _longest_first(units: Sequence[_Unit], num_fragments: int) -> tuple[list[list[str]], list[int]]:
    frags: list[list[str]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments
    for u in sorted(units, key=lambda u: -u.size):
        # empty fragments first, even against zero-element ones, so none stays empty
        f = min(range(num_fragments), key=lambda i: (loads[i], len(frags[i])))
        frags[f].extend(u.names)
        loads[f] += u.size
    return frags, loads


def _too_coarse_error(
    units: Sequence[_Unit], loads: Sequence[int], total: int, num_fragments: int, tolerance: float
) -> ValueError:
    if len(units) < num_fragments:
        return ValueError(
            f"the model has {len(units)} trainable parameter(s), too few for {num_fragments} fragments; "
            "pass fewer fragments"
        )
    biggest = max(units, key=lambda u: u.size)
    needed = max(loads) * num_fragments / total - 1
    return ValueError(
        f"cannot split {total:,} trainable elements into {num_fragments} fragments with tolerance={tolerance} "
        f"(at most {(1 + tolerance) * total / num_fragments:,.0f} elements per fragment): the best split "
        f"found has a fragment of {max(loads):,}, and the largest indivisible parameter is {biggest.path!r} "
        f"({biggest.size:,} elements). Pass fewer fragments or a larger tolerance (tolerance={needed + 0.005:.2f} "
        "would do)"
    )


def _balanced(model: nn.Module, sizes: Mapping[str, int], num_fragments: int, tolerance: float) -> list[list[str]]:
    total = sum(sizes.values())
    units = _subunits("", model, list(sizes), sizes)
    while True:
        loads: list[int] = []
        if len(units) >= num_fragments:
            frags, loads = _longest_first(units, num_fragments)
            if max(loads) * num_fragments <= (1 + tolerance) * total:
                return frags
        splittable = {i: u.module for i, u in enumerate(units) if u.module is not None}
        if not splittable:
            raise _too_coarse_error(units, loads, total, num_fragments, tolerance)
        i = max(splittable, key=lambda i: units[i].size)
        units[i : i + 1] = _subunits(units[i].path, splittable[i], units[i].names, sizes)


# --- entry points ----------------------------------------------------------------------------


def _check_arguments(
    num_fragments: int,
    blocks: str | None,
    block_pattern: str | None,
    groups: Sequence[Sequence[str]] | None,
    pattern: Pattern | None,
    rest: Rest | None,
    tolerance: float,
) -> None:
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    rules = (("blocks", blocks), ("block_pattern", block_pattern), ("groups", groups))
    chosen = [k for k, v in rules if v is not None]
    if len(chosen) > 1:
        raise ValueError(f"pass at most one of blocks, block_pattern and groups (got {', '.join(chosen)})")
    if pattern not in (None, "strided", "sequential"):
        raise ValueError(f"unknown fragment pattern {pattern!r}; choose strided or sequential")
    if pattern is not None and blocks is None and block_pattern is None:
        raise ValueError("pattern orders blocks: pass it with blocks= or block_pattern=")
    if rest is not None and not chosen:
        raise ValueError("rest places what a blocks=, block_pattern= or groups= rule leaves out; "
                         "the default rule places every parameter itself")
    if rest not in (None, "balance", "own"):
        raise ValueError(f"unknown rest policy {rest!r}; choose balance or own")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")


def _in_model_order(frags: list[list[str]], sizes: Mapping[str, int]) -> list[list[str]]:
    order = {n: i for i, n in enumerate(sizes)}
    return [sorted(f, key=order.__getitem__) for f in frags if f]


def partition(
    model: nn.Module,
    num_fragments: int,
    *,
    pattern: Pattern | None = None,
    blocks: str | None = None,
    block_pattern: str | None = None,
    groups: Sequence[Sequence[str]] | None = None,
    rest: Rest | None = None,
    tolerance: float = 0.25,
) -> list[list[str]]:
    """Names of the trainable parameters of each fragment (see the module docstring for the rules).

    Args:
        model: any ``nn.Module``; only parameters with ``requires_grad`` are placed.
        num_fragments: P, the number of fragments (``rest="own"`` adds one more).
        pattern: ``"strided"`` (default) or ``"sequential"``: how blocks map to fragments.
        blocks: dotted path of the ``ModuleList``/``Sequential`` holding the repeated blocks.
        block_pattern: regex on parameter names whose first group is the block key.
        groups: one list of name prefixes per fragment (``len(groups) == num_fragments``).
        rest: ``"balance"`` (default) or ``"own"``: where parameters outside the blocks or
            groups go.
        tolerance: default rule only; the largest fragment may hold at most
            ``(1 + tolerance) * total / num_fragments`` elements (``numel``).

    Returns:
        Non-empty lists of names, in ``named_parameters`` order within each; together they hold
        every trainable parameter exactly once.

    Raises:
        ValueError: a rule that matches nothing, conflicting options, or a split that cannot
            meet ``tolerance``; the message says what to pass instead.
    """
    _check_arguments(num_fragments, blocks, block_pattern, groups, pattern, rest, tolerance)
    sizes = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    if groups is not None:
        if len(groups) != num_fragments:
            raise ValueError(f"groups has {len(groups)} entries but num_fragments is {num_fragments}")
        frags = _by_groups(model, list(sizes), groups)
        return _in_model_order(_place_rest(frags, sizes, rest or "balance"), sizes)
    if blocks is None and block_pattern is None:
        if num_fragments == 1:
            return [list(sizes)]
        frags = _in_model_order(_balanced(model, sizes, num_fragments, tolerance), sizes)
        return sorted(frags, key=lambda f: list(sizes).index(f[0]))
    if block_pattern is not None:
        keys = _block_keys_from_pattern(model, block_pattern)
    else:
        keys = _block_keys_from_modules(model, blocks)
    if num_fragments == 1:
        return [list(sizes)]
    frags = _by_blocks(keys, list(sizes), num_fragments, pattern or "strided")
    return _in_model_order(_place_rest(frags, sizes, rest or "balance"), sizes)


def gpt_fragments(model: nn.Module, num_fragments: int, pattern: Pattern = "strided") -> list[list[str]]:
    """Preset for ``diloco.demo.model.GPT`` (and nanoGPT-style models with ``.blocks``)."""
    return partition(model, num_fragments, pattern=pattern, blocks="blocks")
