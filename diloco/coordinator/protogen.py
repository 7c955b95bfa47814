"""Regenerate the committed Python code of ``coordinator.proto`` (needs ``grpcio-tools``, a dev extra).

From the repository root::

    python -m diloco.coordinator.protogen            # rewrites coordinator_pb2.py and .pyi
    python -m diloco.coordinator.protogen --check    # exit 1 if they are stale

The output depends on the protoc bundled with grpcio-tools (pinned in the ``dev`` extra): its
version is written into ``coordinator_pb2.py`` and sets the oldest ``protobuf`` runtime that can
load it, which is the lower bound of the ``protobuf`` dependency in ``pyproject.toml``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "diloco/coordinator/coordinator.proto"  # relative to ROOT: also its name in the descriptor pool
OUTPUTS = ("diloco/coordinator/coordinator_pb2.py", "diloco/coordinator/coordinator_pb2.pyi")


def generate(out_dir: str | Path) -> dict[str, Path]:
    """Compile ``coordinator.proto`` into ``out_dir`` (same relative layout as the repository);
    returns ``{relative path: written file}`` for OUTPUTS. Raises RuntimeError if protoc fails
    and ImportError without grpcio-tools."""
    from importlib import resources

    from grpc_tools import protoc

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    include = str(resources.files("grpc_tools") / "_proto")  # google/protobuf/*.proto
    code = protoc.main(["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}",
                        f"--pyi_out={out}", str(ROOT / PROTO)])
    if code != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {code}); its message is above")
    return {rel: out / rel for rel in OUTPUTS}


def gencode_version(pb2_source: str) -> str:
    """The protobuf version a generated ``_pb2.py`` was made for (its ``Protobuf Python Version``)."""
    found = re.search(r"^# Protobuf Python Version: (\S+)$", pb2_source, re.MULTILINE)
    if found is None:
        raise ValueError("no 'Protobuf Python Version' line: not protoc's output")
    return found.group(1)


def serialized_descriptor(pb2_source: str) -> bytes:
    """The serialized FileDescriptorProto a generated ``_pb2.py`` registers: the whole schema."""
    found = re.search(r"AddSerializedFile\((b'.*?')\)\n", pb2_source)
    if found is None:
        raise ValueError("no AddSerializedFile(...) call: not protoc's output")
    return ast.literal_eval(found.group(1))


def stale() -> tuple[list[str], str | None]:
    """(committed outputs that a fresh generation would change, a note or None).

    With the same protoc as the committed code, the files must match byte for byte. With another
    protoc (the note says which), only the schema itself is compared: the descriptor the
    ``_pb2.py`` registers, since the surrounding code and the ``.pyi`` vary across versions."""
    with tempfile.TemporaryDirectory(prefix="diloco-protogen-") as tmp:
        fresh = {rel: path.read_bytes() for rel, path in generate(tmp).items()}
    committed = {rel: (ROOT / rel).read_bytes() for rel in OUTPUTS if (ROOT / rel).exists()}
    if set(committed) != set(fresh):
        return sorted(set(fresh) - set(committed)), None
    pb2 = OUTPUTS[0]
    old_text, new_text = committed[pb2].decode(), fresh[pb2].decode()
    old_version, new_version = gencode_version(old_text), gencode_version(new_text)
    if old_version == new_version:
        return [rel for rel in OUTPUTS if committed[rel] != fresh[rel]], None
    note = (f"installed protoc makes protobuf {new_version} code, the committed code is for "
            f"{old_version}: compared the schema only (install the grpcio-tools of the dev extra)")
    return ([pb2] if serialized_descriptor(old_text) != serialized_descriptor(new_text) else []), note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco.coordinator.protogen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        old, note = stale()
        if note:
            print(f"note: {note}", file=sys.stderr)
        for rel in old:
            print(f"stale: {rel} (run python -m diloco.coordinator.protogen)", file=sys.stderr)
        return 1 if old else 0
    generate(ROOT)
    print("\n".join(f"wrote {rel}" for rel in OUTPUTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
