"""Run a test module again in a subprocess with TRITON_INTERPRET=1.

Triton decides whether to interpret when it is first imported, so kernels
cannot be switched to the CPU interpreter inside the main pytest process; each
Triton test module has one test that re-runs the module interpreted.
"""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(module_file: str, skip_reason: str) -> None:
    """Run ``module_file``'s tests interpreted; every one must run (none skipped for ``skip_reason``)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", module_file],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout, result.stdout[-2000:]
    assert skip_reason not in result.stdout, result.stdout[-2000:]
