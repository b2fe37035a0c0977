"""The GPU check's plumbing on a CPU: scripts/gpu_check.sh's one-call plan, its steps
reporting, and scripts/fetch_device_wheels.sh's dry run and size check (no network)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = [
    "pytest_a",
    "gpu_decode",
    "flashinfer",
    "pytest_b",
    "gpu_decode_hf",
    "attention",
    "passes",
    "padding",
]
CALL_LIMIT = 600  # seconds one device call may run


def run_check(tmp_path: Path, part: str = "all", **env: str) -> subprocess.CompletedProcess:
    environ = {
        **os.environ,
        "GPU_CHECK_DEVICE": "cpu",
        "OUT": str(tmp_path / "out"),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "PYTHON": sys.executable,
        **env,
    }
    environ.pop("COMPILE_RUNTIME_DEVICE", None)
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", part],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=900,
    )


def plan_shares(stdout: str) -> dict[str, int]:
    """The plan the script printed first: each step's share in seconds, setup's too."""
    shares = {}
    for line in stdout.splitlines():
        m = re.match(r"^(?:\d+\.|  ) ([a-z_]+)\s+~?(\d+)s  ", line)
        if m:
            shares[m.group(1)] = int(m.group(2))
        if line.startswith("== dependencies"):
            break
    return shares


def summary(stdout: str) -> dict[str, str]:
    lines = stdout.split("== summary:", 1)[1].splitlines()[1:]
    return dict(line.split(": ", 1) for line in lines if re.match(r"^[a-z_]+: ", line))


@pytest.mark.slow
def test_all_in_one_call_on_a_cpu(tmp_path):
    """The plan fits one call; the steps run in its order, each reports, exit status 0."""
    selected = ["pytest_a", "flashinfer", "gpu_decode_hf"]
    done = run_check(
        tmp_path,
        GPU_CHECK_STEPS=" ".join(selected),
        GPU_CHECK_PYTEST="-m cuda tests/test_cudagraph_cuda.py",
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-2000:]
    shares = plan_shares(out)
    assert list(shares) == ["setup", *STEPS]  # most important first
    assert sum(shares.values()) <= CALL_LIMIT - 20
    assert "one device call runs at most 600s: fits" in out
    for name in STEPS:  # every step in its plan order, each with its time limit printed
        if name in selected:
            assert re.search(rf"^== {name} \(at most \d+s; \d+s kept", out, re.M), name
    reports = summary(out)
    assert list(reports) == STEPS
    for name in STEPS:
        expected = "ok (" if name in selected else "not run (GPU_CHECK_STEPS)"
        assert reports[name].startswith(expected), (name, reports[name])
    # FlashInfer's step on a CPU: the plan of the JIT build, the CPU's backends standing in.
    assert "FlashInfer JIT: decode + prefill, head dim 64" in out
    assert "| eager/cpu_batched |" in out and "= eager/torch_native" in out
    assert "hf_reduce_overhead | torch.compile backend=eager" in out
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["check.log", "flashinfer_decode.json", "gpu_decode_hf.json"]
    assert len(files) <= 8  # what one call brings back


def test_a_build_over_its_bound_skips_flashinfer(tmp_path):
    """A JIT build that does not fit its bound: the step says so, and is skipped, not failed."""
    done = run_check(tmp_path, GPU_CHECK_STEPS="flashinfer", GPU_CHECK_FLASHINFER_BUILD="0")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "did not finish in" in done.stdout
    assert summary(done.stdout)["flashinfer"].startswith("SKIPPED (JIT build over 1s")


def test_usage_errors(tmp_path):
    assert run_check(tmp_path, part="c").returncode == 2
    done = run_check(tmp_path, part="a", GPU_CHECK_STEPS="flashinfer")
    assert done.returncode == 2 and "part a has no step flashinfer" in done.stderr


def fetch(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/fetch_device_wheels.sh", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_fetch_dry_run_lists_the_wheels_and_the_room_left(tmp_path):
    done = fetch("--dry-run", WHEELS_DIR=str(tmp_path / "none"))
    assert done.returncode == 0, done.stderr
    for name in (
        "pydantic==",
        "flashinfer-python==",
        "apache-tvm-ffi==",
        "ninja==",
        "nvidia-ml-py==",
    ):
        assert name in done.stdout, name
    tree = int(re.search(r"working tree .*?: (\d+) bytes", done.stdout).group(1))
    assert 0 < tree < 64 * 2**20
    assert "room for wheels" in done.stdout


def test_fetch_size_check_fails_over_64_mib(tmp_path):
    wheels = tmp_path / "wheels"
    (wheels / "flashinfer").mkdir(parents=True)
    with open(wheels / "flashinfer" / "big-1.0-py3-none-any.whl", "wb") as f:
        f.truncate(64 * 2**20)  # sparse: its size, no disk
    done = fetch("--dry-run", WHEELS_DIR=str(wheels))
    assert done.returncode == 1
    assert "TOO LARGE" in done.stderr and "big-1.0-py3-none-any.whl" in done.stdout
    assert fetch("--bogus").returncode == 2
