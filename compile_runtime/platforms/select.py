"""``platform_for(device)``: the platform of a device (a ``torch.device`` or its name)."""

from __future__ import annotations

import torch

from compile_runtime.platforms.base import Platform
from compile_runtime.platforms.cpu import CPU
from compile_runtime.platforms.cuda import CUDA

_PLATFORMS = {p.name: p for p in (CPU, CUDA)}


def platform_for(device: torch.device | str) -> Platform:
    kind = torch.device(device).type
    if kind not in _PLATFORMS:
        raise ValueError(f"no platform for device {str(device)!r}; use 'cpu' or 'cuda[:N]'")
    return _PLATFORMS[kind]
