"""The device an engine runs on when the caller does not name one.

CUDA when this machine has it, else the CPU; ``COMPILE_RUNTIME_DEVICE``
(``cpu``, ``cuda``, ``cuda:N``) overrides that for a whole process and the
processes it starts (the test suite pins its CPU tests with it, so a GPU
machine does not turn them into CUDA tests).
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "COMPILE_RUNTIME_DEVICE"


def default_device() -> str:
    """``$COMPILE_RUNTIME_DEVICE`` when set, else ``"cuda"`` when available, else ``"cpu"``."""
    value = os.environ.get(DEVICE_ENV, "").strip()
    if not value:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(value).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(
            f"{DEVICE_ENV}={value!r} is not a device; set it to 'cpu', 'cuda' or 'cuda:N', "
            "or unset it to use CUDA when available"
        )
    return value


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as given, or the default."""
    return torch.device(device if device is not None else default_device())
