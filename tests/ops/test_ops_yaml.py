"""Every YAML file under deploy/ passes yamllint (deploy/.yamllint.yml)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ops_helpers import DEPLOY


def test_deploy_yaml_passes_yamllint():
    pytest.importorskip("yamllint", reason="pip install yamllint (in the dev extras)")
    files = sorted(str(p) for p in DEPLOY.rglob("*.y*ml") if p.name != ".yamllint.yml")
    assert len(files) >= 15, files
    result = subprocess.run([sys.executable, "-m", "yamllint", "--strict", "-c", str(DEPLOY / ".yamllint.yml"), *files],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
