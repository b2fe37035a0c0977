"""scripts/gpu_check.sh: its usage errors, its answer without CUDA, and the CPU smoke of parts a
and b (``GPU_CHECK_DEVICE=cpu``: every step, tiny settings). Part c's smoke (25-50 s on a 2-core
machine) runs by hand: ``GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh c``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MAX_FILES = 4  # what one device call may bring back, by our own rule


@pytest.fixture
def run_check(tmp_path, session_cache_dir):
    """``run_check(*argv, **env)``: the script with its results and scratch in ``tmp_path``, and
    the session's temporary compile cache (conftest): the CPU attention kernel another test
    compiled is not compiled again."""

    def run(*argv: str, **env: str) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if k != "OUT" and not k.startswith("GPU_")}
        base |= {
            "OUT": str(tmp_path / "out"),
            "GPU_CHECK_WORK": str(tmp_path / "work"),
            "COMPILE_RUNTIME_CACHE_DIR": session_cache_dir,
            "PYTHON": sys.executable,
            # One thread: a smoke test, and no OpenMP stalls when other processes keep the
            # cores busy (conftest pins the count to all cores otherwise).
            "OMP_NUM_THREADS": "1",
        }
        return subprocess.run(
            ["bash", str(SCRIPT), *argv],
            cwd=ROOT,
            env=base | env,
            capture_output=True,
            text=True,
            timeout=900,  # a hang guard, not a speed check
        )

    return run


def out_files(tmp_path: Path) -> list[str]:
    out = tmp_path / "out"
    return sorted(p.name for p in out.rglob("*") if p.is_file()) if out.exists() else []


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@pytest.mark.parametrize("argv", [(), ("d",), ("a", "b")])
def test_a_missing_or_unknown_part_prints_usage_and_exits_2(run_check, tmp_path, argv):
    result = run_check(*argv)
    assert result.returncode == 2, explain(result)
    assert "usage: bash scripts/gpu_check.sh a|b|c" in result.stderr
    assert out_files(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_it_says_so_and_exits_1(run_check, tmp_path):
    result = run_check("a")
    assert result.returncode == 1, explain(result)
    assert "CUDA is not available" in result.stderr
    assert "GPU_CHECK_DEVICE=cpu" in result.stderr
    assert out_files(tmp_path) == []


@pytest.mark.slow
def test_a_step_without_time_is_not_started_and_the_part_fails(run_check, tmp_path):
    result = run_check("c", GPU_CHECK_DEVICE="cpu", GPU_CHECK_BUDGET="20")
    assert result.returncode == 1, explain(result)
    assert "padding: NOT STARTED" in result.stdout
    assert out_files(tmp_path) == []


@pytest.mark.slow
def test_part_a_cpu_smoke(run_check, tmp_path):
    result = run_check("a", GPU_CHECK_DEVICE="cpu")
    assert result.returncode == 0, explain(result)
    files = out_files(tmp_path)
    assert files == ["gpu_decode.json", "gpu_decode.log", "pytest.log"]
    assert len(files) <= MAX_FILES
    header = "| batch | eager | piecewise | full | full_and_piecewise | hf_reduce_overhead |"
    assert header in result.stdout
    assert "pytest: ok" in result.stdout and "gpu_decode: ok" in result.stdout
    data = json.loads((tmp_path / "out" / "gpu_decode.json").read_text())
    status = {name: c["status"] for name, c in data["configs"].items()}
    assert status == {
        "eager": "ok",
        "piecewise": "ok",
        "full": "ok",
        "full_and_piecewise": "ok",
        "hf_reduce_overhead": "skipped",  # reduce-overhead needs CUDA
    }
    assert set(data["configs"]["piecewise"]["decode_ms"]) == {"1", "2"}
    # The benchmark's progress lines go to its log, not to the (size-limited) stdout.
    assert "# eager batch 1" not in result.stdout
    assert "# eager batch 1" in (tmp_path / "out" / "gpu_decode.log").read_text()


@pytest.mark.slow
def test_part_b_cpu_smoke(run_check, tmp_path):
    result = run_check("b", GPU_CHECK_DEVICE="cpu")
    assert result.returncode == 0, explain(result)
    files = out_files(tmp_path)
    assert files == ["attention.json", "attention.log", "passes.json", "passes.log"]
    assert len(files) <= MAX_FILES
    assert "backend        batch   mode   ms/call  build ms" in result.stdout
    assert "| tokens | off (ms) |" in result.stdout
    assert "attention: ok" in result.stdout and "passes: ok" in result.stdout
