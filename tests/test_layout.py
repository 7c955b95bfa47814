"""The package layout of ARCHITECTURE.md holds: imports run one way, and no two modules import each other.

Imports are read from the source (``ast``; every ``import``, also those inside functions and under
``TYPE_CHECKING``), so these tests load nothing of the project and take well under a second.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("diloco", "transport", "compress")

# which sub-packages of diloco each one may import (besides itself, transport and compress)
ALLOWED = {
    "engine": set(),
    "coordinator": set(),
    "job": {"engine"},
    "demo": {"job", "engine"},
    "integrations": {"demo", "job", "engine"},
    "exchange": {"coordinator", "engine"},
    "runtime": {"job", "demo", "exchange", "coordinator", "engine"},
}
TOP_LEVEL_MODULES = {"__init__", "__main__", "cli", "cli_parser"}  # diloco/*.py besides the sub-packages
# inside diloco/runtime/: which of its sub-packages each one may import (besides itself)
RUNTIME_ALLOWED = {
    "ops": set(),
    "checkpoints": set(),
    "rank": {"checkpoints", "ops"},
    "launch": {"rank", "checkpoints", "ops"},
}
# a process or a socket: what the algorithm must not touch
PROCESS_AND_SOCKET_MODULES = {"socket", "subprocess", "multiprocessing", "signal", "grpc", "transport", "selectors"}


NOT_PYTHON = {"compress._native"}  # C extensions: nothing to read


@functools.cache
def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the three packages by dotted name (a package by its own name)."""
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module an imported dotted name lives in (None: not one of ours)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def imports_of(name: str, root: Path = ROOT) -> frozenset[str]:
    """Our modules that module ``name`` imports."""
    known = modules(root)
    path = known[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            # "from pkg import sub" imports the submodule when there is one, else a name of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known | dict.fromkeys(NOT_PYTHON) else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PACKAGES and target not in NOT_PYTHON:
                if (resolved := _resolve(target, known)) not in (None, name):
                    found.add(resolved)
    return frozenset(found)


def diloco_subpackage(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "diloco" and len(parts) > 1 and parts[1] in ALLOWED else None


def test_no_two_modules_import_each_other():
    mutual = sorted(f"{a} <-> {b}" for a in modules() for b in imports_of(a) if a < b and a in imports_of(b))
    assert not mutual, f"modules that import each other: {mutual}"


def test_diloco_subpackages_import_one_way():
    wrong = []
    for name in modules():
        own = diloco_subpackage(name)
        if own is None:
            continue
        for target in imports_of(name):
            other = diloco_subpackage(target)
            if target.startswith("diloco") and other != own and other not in ALLOWED[own]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, f"imports against the layout's direction (ARCHITECTURE.md): {wrong}"


def test_the_lower_packages_know_nothing_of_the_higher_ones():
    wrong = [f"{name} -> {target}" for name in modules() for target in imports_of(name)
             if (name.startswith("compress") and not target.startswith("compress"))
             or (name.startswith("transport") and target.startswith("diloco"))]
    assert not wrong, f"diloco -> transport -> compress is one way: {wrong}"


def test_the_algorithm_touches_no_process_or_socket():
    wrong = []
    for name, path in modules().items():
        if diloco_subpackage(name) != "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                wrong += [f"{name} imports {n}" for n in names if n.split(".")[0] in PROCESS_AND_SOCKET_MODULES]
    assert not wrong, wrong


def runtime_subpackage(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if parts[:2] == ["diloco", "runtime"] and len(parts) > 2 else None


def test_runtime_subpackages_import_one_way():
    wrong = []
    for name in modules():
        own = runtime_subpackage(name)
        if own is None:
            continue
        for target in imports_of(name):
            other = runtime_subpackage(target)
            if target.startswith("diloco.runtime") and other != own and other not in RUNTIME_ALLOWED[own]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, f"imports against the runtime layout's direction (ARCHITECTURE.md): {wrong}"


def test_runtime_holds_only_its_subpackages():
    runtime = ROOT / "diloco" / "runtime"
    flat = {p.stem for p in runtime.glob("*.py")}
    assert flat == {"__init__"}, f"modules of diloco/runtime outside a sub-package: {sorted(flat - {'__init__'})}"
    folders = {p.name for p in runtime.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(RUNTIME_ALLOWED), \
        f"runtime sub-packages not in the layout: {sorted(folders ^ set(RUNTIME_ALLOWED))}"
    for folder in RUNTIME_ALLOWED:
        doc = ast.get_docstring(ast.parse((runtime / folder / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"diloco/runtime/{folder}/__init__.py needs a docstring saying what goes there"


def test_diloco_holds_only_its_subpackages_and_the_command():
    flat = {p.stem for p in (ROOT / "diloco").glob("*.py")}
    assert flat == TOP_LEVEL_MODULES, f"modules outside a sub-package: {sorted(flat - TOP_LEVEL_MODULES)}"
    folders = {p.name for p in (ROOT / "diloco").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ALLOWED), f"sub-packages not in the layout: {sorted(folders ^ set(ALLOWED))}"


def test_every_subpackage_says_what_it_holds():
    for folder in ALLOWED:
        doc = ast.get_docstring(ast.parse((ROOT / "diloco" / folder / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"diloco/{folder}/__init__.py needs a docstring saying what goes there"


def test_architecture_md_names_every_subpackage():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"diloco/(\w+)/", text))
    assert set(ALLOWED) <= named, f"ARCHITECTURE.md does not name {sorted(set(ALLOWED) - named)}"
    in_runtime = set(re.findall(r"runtime/(\w+)/", text))
    assert set(RUNTIME_ALLOWED) <= in_runtime, \
        f"ARCHITECTURE.md does not name runtime/{sorted(set(RUNTIME_ALLOWED) - in_runtime)}"


def test_the_import_reader_sees_every_form_of_import(tmp_path):
    """A mutual pair written with relative, absolute, function-local and TYPE_CHECKING imports is found."""
    pkg = tmp_path / "compress"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (pkg / "c.py").write_text("import compress.sub.b\nfrom compress import _native\n")
    assert imports_of("compress.a", tmp_path) == {"compress.sub.b"}
    assert imports_of("compress.sub.b", tmp_path) == {"compress.a"}
    assert imports_of("compress.c", tmp_path) == {"compress.sub.b"}


def bench_imports(path: Path) -> set[str]:
    """The bench scripts (``bench/NAME.py``) that the bench script ``path`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "bench":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
    return found - {path.stem}


def test_no_two_bench_scripts_import_each_other():
    found = {path.stem: bench_imports(path) for path in (ROOT / "bench").glob("*.py")}
    mutual = sorted(f"bench.{a} <-> bench.{b}" for a in found for b in found[a] if a < b and a in found.get(b, ()))
    assert not mutual, f"bench scripts that import each other (pass what one needs as an argument): {mutual}"
