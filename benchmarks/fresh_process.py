"""Run a benchmark's child step in a new process with empty compile caches (a cold start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def run_child(script: str, *args: str) -> dict:
    """``python script --child ARGS`` with a fresh Inductor cache and a fresh default compile
    cache (a child that wants ours warm passes its own ``cache_dir``); its last stdout line
    as JSON."""
    with tempfile.TemporaryDirectory() as inductor_cache, tempfile.TemporaryDirectory() as ours:
        env = dict(
            os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache, COMPILE_RUNTIME_CACHE_DIR=ours
        )
        proc = subprocess.run(
            [sys.executable, script, "--child", *args], capture_output=True, text=True, env=env
        )
    if proc.returncode:
        raise SystemExit(
            f"{os.path.basename(script)} --child {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])
