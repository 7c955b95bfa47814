"""Every repository file that the documentation or the code's docstrings and comments point to exists.

Scanned: README.md, ARCHITECTURE.md, docs/**/*.md, deploy/**/*.md, bench/**/*.md, and the
docstrings (every bare string statement) and comments of every .py file under diloco/, transport/,
compress/, bench/ and examples/. A reference is

* a markdown link or image ``[text](target)`` whose target is a relative path (http(s), mailto
  and other schemes, pure ``#anchors`` and absolute paths are skipped; ``#anchor`` is cut off);
* a bare mention of ``SOMETHING.md`` (``ALGORITHMS.md``, ``bench/README.md``, ``docs/x.md``);
* a bare mention of a path under ``docs/``, ``bench/``, ``deploy/``, ``examples/``, or the code's and
  tests' folders (``diloco/``, ``transport/``, ``compress/``, ``tests/``).

A reference resolves if the path exists relative to the repository root or to the folder of the
file that mentions it. A failure lists every dangling reference as ``file:line -> path``.
Pure text scanning (no torch, no imports of the project): well under a second.
"""

from __future__ import annotations

import ast
import functools
import io
import os
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MARKDOWN_GLOBS = ("README.md", "ARCHITECTURE.md", "docs/**/*.md", "deploy/**/*.md", "bench/**/*.md")
CODE_FOLDERS = ("diloco", "transport", "compress", "bench", "examples")

URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
# [text](target) or ![alt](target); target may be <...> and may carry a "title"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
# a word that ends in .md, possibly with folders: ALGORITHMS.md, bench/README.md, ../x.md
MD_MENTION = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)?[\w-][\w./-]*\.md)(?![\w-])")
# a path under one of the folders users are sent to: docs/x, bench/y.py, deploy/z, examples/w
# (not right after a quote: "diloco/data-plane/pair/v1" is a key-derivation label, not a path)
DIR_MENTION = re.compile(r"(?<![\w/.\"-])((?:docs|bench|deploy|examples|diloco|transport|compress|tests)/[\w./-]*[\w-])")


def references_in_text(line: str) -> list[str]:
    """Repository paths referenced on one line of text (markdown links first, then bare mentions)."""
    refs: list[str] = []
    for m in LINK.finditer(line):
        target = m.group(1).strip("<>").split("#", 1)[0]
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("/"):
            continue
        refs.append(target)
    rest = URL.sub(" ", LINK.sub(" ", line))
    for pattern in (MD_MENTION, DIR_MENTION):
        for m in pattern.finditer(rest):
            refs.append(m.group(1))
    return list(dict.fromkeys(refs))


def markdown_lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text(encoding="utf-8").splitlines(), start=1))


def python_doc_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every line of a docstring / bare string statement."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            for n in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                out.append((n, lines[n - 1]))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return sorted(out)


def scanned_files() -> list[Path]:
    files: set[Path] = set()
    for pattern in MARKDOWN_GLOBS:
        files.update(p for p in ROOT.glob(pattern) if p.is_file())
    for folder in CODE_FOLDERS:
        if (ROOT / folder).is_dir():
            files.update(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(files)


def resolves(ref: str, referrer: Path) -> bool:
    ref = ref.rstrip("/")
    if (ROOT / ref).exists() or (referrer.parent / ref).exists():
        return True
    beside = Path(os.path.normpath(ROOT / ref))
    # a folder beside the repository (../shared) is checked where the checkout has it (CI does); a
    # copy of the repository alone (a GPU host's) cannot say
    return not beside.is_relative_to(ROOT) and beside.is_relative_to(ROOT.parent) and \
        not (ROOT.parent / beside.relative_to(ROOT.parent).parts[0]).exists()


@functools.lru_cache(maxsize=1)
def all_references() -> tuple[tuple[Path, int, str], ...]:
    found = []
    for path in scanned_files():
        lines = python_doc_lines(path) if path.suffix == ".py" else markdown_lines(path)
        for number, text in lines:
            for ref in references_in_text(text):
                found.append((path, number, ref))
    return tuple(found)


def test_the_scanner_finds_links_and_bare_mentions():
    line = ("see [the notes](docs/algorithms.md#s33-x), ALGORITHMS.md §3.3, `bench/README.md`, "
            "python bench/codecs.py --json bench/results/codecs.json, ![plot](results/a.png), "
            "https://example.com/docs/x.md and [web](https://example.com/y.md) and [top](#top)")
    assert references_in_text(line) == [
        "docs/algorithms.md", "results/a.png", "ALGORITHMS.md", "bench/README.md",
        "bench/codecs.py", "bench/results/codecs.json",
    ]
    assert references_in_text("deploy/ is a folder; bench/*.py is a glob; docs/... is elided") == []


def test_the_scan_covers_markdown_and_code():
    files = scanned_files()
    assert ROOT / "README.md" in files
    assert any(p.is_relative_to(ROOT / "bench" / "pages") for p in files), "bench/pages/*.md not scanned"
    assert any(p.suffix == ".py" and p.is_relative_to(ROOT / "diloco") for p in files)
    assert len(all_references()) >= 5, "the scanner found almost no references: is it broken?"


def test_every_referenced_repository_file_exists():
    dangling = [f"{path.relative_to(ROOT)}:{line} -> {ref}"
                for path, line, ref in all_references() if not resolves(ref, path)]
    assert not dangling, (
        f"{len(dangling)} reference(s) to files that are not in the repository:\n  "
        + "\n  ".join(dangling)
    )


DOTTED = re.compile(r"(?<![\w./-])diloco\.([a-z_]\w*)(?![\w/-])")
# where the layout's move is explained, the old module paths are named on purpose
OLD_PATHS_NAMED_IN = {"ARCHITECTURE.md", "diloco/job/task.py"}


def diloco_top_level_names() -> set[str]:
    """What ``diloco.X`` may name: its modules and sub-packages, and its public (lazy) names."""
    init = ast.parse((ROOT / "diloco" / "__init__.py").read_text())
    exports = next(node.value for node in init.body if isinstance(node, ast.Assign)
                   and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets))
    names = {key.value for key in exports.keys}  # type: ignore[union-attr]
    names |= {p.stem for p in (ROOT / "diloco").glob("*.py")}
    return names | {p.name for p in (ROOT / "diloco").iterdir() if (p / "__init__.py").exists()}


def test_every_dotted_diloco_name_exists():
    """``diloco.worker`` in a doc after the worker moved to ``diloco.runtime.rank.worker`` is caught."""
    known = diloco_top_level_names()
    assert {"DiLoCo", "connect", "runtime", "engine", "cli"} <= known
    stale = []
    for path in scanned_files():
        lines = python_doc_lines(path) if path.suffix == ".py" else markdown_lines(path)
        for number, text in lines:
            for m in DOTTED.finditer(URL.sub(" ", text)):
                if (m.group(1) not in known and m.group(1) not in ("json", "toml", "yaml", "py", "log")
                        and str(path.relative_to(ROOT)) not in OLD_PATHS_NAMED_IN):
                    stale.append(f"{path.relative_to(ROOT)}:{number} -> diloco.{m.group(1)}")
    assert not stale, "names that are not in diloco:\n  " + "\n  ".join(stale)
