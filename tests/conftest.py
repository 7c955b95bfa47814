"""Makes tests/cuda_helpers.py importable from every test folder (pytest runs with --import-mode=importlib)."""

import sys
from pathlib import Path

_here = str(Path(__file__).resolve().parent)
if _here not in sys.path:
    sys.path.append(_here)
