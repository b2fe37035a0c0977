"""scripts/gpu_check.sh: its usage errors, its answer without CUDA, the CPU smoke of parts a and
b (``GPU_CHECK_DEVICE=cpu``: every step, tiny settings; 60-90 s each on a 2-core machine) with
the device's missing test dependencies simulated (the modules that skip are listed), a step
without time, and a pytest step cut at its limit that still prints its summary."""

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
MAX_FILES = 8  # what one device call brings back from $OUT
# Missing on the GPU machine (nothing of ours is installed there): the modules asking for them
# with pytest.importorskip must skip. hypothesis is there (and its pytest plugin with it).
MISSING_THERE = ("openai", "jsonschema")
BLOCKER = """\
import importlib.machinery
import os

BLOCKED = set(os.environ["GPU_CHECK_TEST_BLOCKED"].split())
_find_spec = importlib.machinery.PathFinder.find_spec.__func__


def find_spec(cls, fullname, path=None, target=None):
    if fullname.split(".")[0] in BLOCKED:
        return None  # not found: ModuleNotFoundError, as where it is not installed
    return _find_spec(cls, fullname, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
"""


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


@pytest.fixture
def as_on_the_device(tmp_path) -> dict[str, str]:
    """Environment in which ``MISSING_THERE`` cannot be imported (a sitecustomize first on
    PYTHONPATH), as on the GPU machine."""
    site = tmp_path / "blocker"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "GPU_CHECK_TEST_BLOCKED": " ".join(MISSING_THERE)}


def out_files(tmp_path: Path) -> list[str]:
    out = tmp_path / "out"
    return sorted(p.name for p in out.rglob("*") if p.is_file()) if out.exists() else []


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def assert_skips_listed(stdout: str) -> None:
    """The listing step names the modules that skip and why."""
    assert "optional test dependencies: " in stdout
    assert "openai NO" in stdout and "jsonschema NO" in stdout and "hypothesis yes" in stdout
    assert "skips: tests/test_server.py (missing openai)" in stdout
    assert "skips: tests/test_server_api.py (missing openai)" in stdout  # through serving.py
    assert "skips: tests/test_server_structured.py (missing jsonschema)" in stdout
    assert "skips: tests/test_structured_outputs.py (missing jsonschema)" in stdout
    assert "test modules skip here" in stdout


@pytest.mark.parametrize("argv", [(), ("c",), ("a", "b")])
def test_a_missing_or_unknown_part_prints_usage_and_exits_2(run_check, tmp_path, argv):
    result = run_check(*argv)
    assert result.returncode == 2, explain(result)
    assert "usage: bash scripts/gpu_check.sh a|b" in result.stderr
    assert out_files(tmp_path) == []


def test_an_unknown_step_is_a_usage_error(run_check, tmp_path):
    result = run_check("a", GPU_CHECK_DEVICE="cpu", GPU_CHECK_STEPS="pytest_a padding")
    assert result.returncode == 2, explain(result)
    assert "part a has no step padding" in result.stderr
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
    result = run_check(
        "b", GPU_CHECK_DEVICE="cpu", GPU_CHECK_BUDGET="20", GPU_CHECK_STEPS="padding"
    )
    assert result.returncode == 1, explain(result)
    assert "padding: NOT STARTED" in result.stdout
    assert "pytest_b: not run (GPU_CHECK_STEPS)" in result.stdout
    # The plan's shares scale with the budget: padding's 60 of 280 s is 4 of 20.
    assert "4. padding           4s" in result.stdout
    assert out_files(tmp_path) == []


@pytest.mark.slow
def test_a_pytest_step_cut_at_its_limit_still_prints_its_summary(run_check, tmp_path):
    tests = tmp_path / "cut"
    tests.mkdir()
    (tests / "test_cut.py").write_text(
        "import time\n\n\ndef test_quick():\n    pass\n\n\n"
        "def test_sleeps():\n    time.sleep(600)\n\n\ndef test_never_reached():\n    pass\n"
    )
    result = run_check(
        "a",
        GPU_CHECK_DEVICE="cpu",
        GPU_CHECK_STEPS="pytest_a",
        GPU_CHECK_PYTEST=str(tests / "test_cut.py"),
        GPU_CHECK_BUDGET="60",
        GPU_CHECK_MIN_STEP="5",
    )
    assert result.returncode == 1, explain(result)
    assert "pytest_a: TIMED OUT" in result.stdout, explain(result)
    assert "KeyboardInterrupt" in result.stdout  # pytest's own report of where it stopped
    assert "test_cut.py:9: KeyboardInterrupt" in result.stdout
    summary = result.stdout.split("== summary")[1]
    assert "1 passed in" in summary  # the step's line carries pytest's summary line
    assert out_files(tmp_path) == ["pytest_a.log"]


@pytest.mark.slow
def test_part_a_cpu_smoke(run_check, tmp_path, as_on_the_device):
    result = run_check("a", GPU_CHECK_DEVICE="cpu", **as_on_the_device)
    assert result.returncode == 0, explain(result)
    files = out_files(tmp_path)
    assert files == [
        "gpu_decode.json",
        "gpu_decode.log",
        "gpu_decode_hf.json",
        "gpu_decode_hf.log",
        "pytest_a.log",
    ]
    assert len(files) <= MAX_FILES
    assert "1. pytest_a        105s" in result.stdout  # the plan, in order, with its shares
    assert "2. gpu_decode      100s" in result.stdout
    assert "3. gpu_decode_hf    50s" in result.stdout
    assert_skips_listed(result.stdout)
    # pytest_a collects every module: its -rs summary gives pytest's own reasons.
    assert "SKIPPED [1] tests/test_server.py" in result.stdout
    assert "could not import 'openai'" in result.stdout
    assert "could not import 'jsonschema'" in result.stdout
    assert "| batch | eager | piecewise | full | full_and_piecewise |" in result.stdout
    assert "| batch | hf_reduce_overhead |" in result.stdout
    assert "pytest_a: ok" in result.stdout and "skipped" in result.stdout.split("pytest_a: ok")[1]
    assert "gpu_decode: ok" in result.stdout and "gpu_decode_hf: ok" in result.stdout
    data = json.loads((tmp_path / "out" / "gpu_decode.json").read_text())
    status = {name: c["status"] for name, c in data["configs"].items()}
    assert status == {"eager": "ok", "piecewise": "ok", "full": "ok", "full_and_piecewise": "ok"}
    assert set(data["configs"]["piecewise"]["decode_ms"]) == {"1", "2"}
    hf = json.loads((tmp_path / "out" / "gpu_decode_hf.json").read_text())
    assert hf["configs"]["hf_reduce_overhead"]["status"] == "skipped"  # needs CUDA graphs
    # The benchmark's progress lines go to its log, not to the (size-limited) stdout.
    assert "# eager batch 1" not in result.stdout
    assert "# eager batch 1" in (tmp_path / "out" / "gpu_decode.log").read_text()


@pytest.mark.slow
def test_part_b_cpu_smoke(run_check, tmp_path, as_on_the_device):
    result = run_check("b", GPU_CHECK_DEVICE="cpu", **as_on_the_device)
    assert result.returncode == 0, explain(result)
    files = out_files(tmp_path)
    assert files == [
        "attention.json",
        "attention.log",
        "padding.json",
        "padding.log",
        "passes.json",
        "passes.log",
        "pytest_b.log",
    ]
    assert len(files) <= MAX_FILES
    assert "1. pytest_b         95s" in result.stdout
    assert "4. padding          60s" in result.stdout
    assert_skips_listed(result.stdout)
    assert "pytest_b: ok" in result.stdout and "skipped" in result.stdout.split("pytest_b: ok")[1]
    assert "backend        batch   mode   ms/call  build ms" in result.stdout
    assert "| tokens | off (ms) |" in result.stdout
    assert "| workload | ladder | graphs |" in result.stdout
    for name in ("attention", "passes", "padding"):
        assert f"{name}: ok" in result.stdout
    padding = json.loads((tmp_path / "out" / "padding.json").read_text())
    assert padding["rows"] and all("ms_per_step" in r for r in padding["rows"])
    assert "stopped" not in padding
