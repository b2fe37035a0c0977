"""What differs by device is decided by the platform: no code outside ``compile_runtime/
platforms/`` (and the CPU platform's own code in ``compile_runtime/cpu/``) branches on a
device's type or asks whether CUDA is there.

What is left outside reads where a *tensor* lives, which is a fact about data, not a
platform decision; each such file is listed with the reason.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A device's type compared or tested, CUDA's presence asked, a device named in a comparison.
DEVICE_CHECK = re.compile(
    r"""\.type\s*(==|!=)\s*["'](cpu|cuda)["']"""
    r"""|\.type\s+(not\s+)?in\s*[(\[{]"""
    r"""|(\bdevice|\))\s*(==|!=)\s*["'](cpu|cuda)["']"""
    r"""|\.is_cuda\b|\.is_cpu\b"""
    r"""|torch\.cuda\.is_available\(\)"""
)
PLATFORM_HOMES = ("compile_runtime/platforms/", "compile_runtime/cpu/", "backends/")
TENSOR_FACTS = {
    # Which kernel a custom op runs is the tensor's device (Triton on CUDA, torch elsewhere).
    "compile_runtime/ops/fused.py",
    # The capture-safety analysis looks for CPU tensors inside a GPU graph.
    "compile_runtime/compiler/capture_safety.py",
    # A step's host copies must be host tensors, checked as given.
    "compile_runtime/attention/metadata.py",
    # Host logits take numpy's vectorised argmax.
    "compile_runtime/worker/sampler.py",
    # The default device is where the platform is chosen: CUDA when present, else the CPU.
    "compile_runtime/device.py",
}


def device_checks() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in ("compile_runtime", "backends", "passes"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel.startswith(PLATFORM_HOMES) or rel in TENSOR_FACTS:
                continue
            lines = [
                f"{n}: {line.strip()}"
                for n, line in enumerate(path.read_text().splitlines(), 1)
                if DEVICE_CHECK.search(line.split("#")[0])
            ]
            if lines:
                found[rel] = lines
    return found


def test_the_pattern_finds_device_checks():
    for line in (
        'if device.type == "cpu":',
        "if torch.device(d).type != 'cuda':",
        "if x.is_cuda:",
        "ok = torch.cuda.is_available()",
        'if device == "cuda":',
        'if (args.device or default_device()) == "cpu":',
        'if device.type not in ("cpu", "cuda"):',
    ):
        assert DEVICE_CHECK.search(line), line
    assert not DEVICE_CHECK.search("platform_for(device).graph_kind == 'cpu'")


def test_only_the_platform_checks_the_device():
    found = device_checks()
    assert not found, f"ask compile_runtime/platforms instead of checking the device: {found}"


def test_each_listed_file_still_reads_a_tensor_device():
    stale = [
        rel
        for rel in sorted(TENSOR_FACTS)
        if not any(
            DEVICE_CHECK.search(line.split("#")[0])
            for line in (REPO / rel).read_text().splitlines()
        )
    ]
    assert not stale, f"no longer needed in TENSOR_FACTS: {stale}"
