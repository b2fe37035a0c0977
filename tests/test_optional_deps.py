"""The server's dependencies stay optional: with fastapi, starlette, uvicorn, openai and
prometheus_client unimportable (``optional_deps_blocker``), every test module either collects
or skips; none fails to import. The engine, the compiler and the non-server commands need none
of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def collect_without_the_server_deps() -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "optional_deps_blocker",
            str(TESTS),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=TESTS.parent,
        timeout=600,
    )


def test_every_test_module_collects_or_skips_without_the_server_deps():
    result = collect_without_the_server_deps()
    out = result.stdout + result.stderr
    errors = [line for line in out.splitlines() if line.startswith("ERROR ")]
    assert result.returncode == 0 and not errors, (
        f"modules that need the server deps:\n{out[-4000:]}"
    )
    assert "(blocked)" in out, "the blocker blocked nothing: the check proves nothing"


def test_the_command_line_runs_without_the_server_deps():
    code = (
        "import optional_deps_blocker\n"
        "from compile_runtime.cli.main import main\n"
        "raise SystemExit(main(['config', 'show']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert '"cudagraph_mode"' in result.stdout
