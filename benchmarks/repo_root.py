"""``import repo_root`` makes testing/ importable: the scaffolding (tiny model directories, toy
models) that benchmarks share with the tests, at the repository root and not installed.

A benchmark runs as ``python benchmarks/x.py``, so Python puts benchmarks/ on the path, not the
repository root. The root goes last on the path: it never shadows the compile_runtime that is
installed (or linked, as in scripts/gpu_check.sh) with the checkout's folder of that name.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)

if ROOT not in sys.path:
    sys.path.append(ROOT)
