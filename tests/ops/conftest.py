"""Shared fixtures of the operations tests; makes ops_helpers importable (--import-mode=importlib)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_here = str(Path(__file__).resolve().parent)
if _here not in sys.path:
    sys.path.insert(0, _here)

from ops_helpers import OVERLAYS, need_binary  # noqa: E402


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """``{overlay name: [objects]}`` as ``kubectl kustomize`` renders every overlay."""
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with yamllint (the dev extras)")
    kubectl = need_binary("kubectl", "it ships kustomize: https://kubernetes.io/docs/tasks/tools/")
    out = {}
    for overlay in OVERLAYS:
        text = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True,
                              timeout=60, check=True).stdout
        out[overlay.name] = [d for d in yaml.safe_load_all(text) if d]
    return out
