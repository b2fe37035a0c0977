"""Run a benchmark's child step in a new process with an empty Inductor cache (a cold start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def run_child(script: str, *args: str) -> dict:
    """``python script --child ARGS`` with a fresh TORCHINDUCTOR_CACHE_DIR; its last stdout line as JSON."""
    with tempfile.TemporaryDirectory() as inductor_cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache)
        proc = subprocess.run(
            [sys.executable, script, "--child", *args], capture_output=True, text=True, env=env
        )
    if proc.returncode:
        raise SystemExit(
            f"{os.path.basename(script)} --child {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])
