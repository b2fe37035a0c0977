"""``platform_for(device)``: the platform of a device (a ``torch.device`` or its name)."""

from __future__ import annotations

import torch

from compile_runtime.platforms.base import Platform
from compile_runtime.platforms.cpu import CPU
from compile_runtime.platforms.cuda import CUDA

# Tensors with shapes and no data (models built to count, tests): the reference attention,
# nothing staged, packed or captured.
META = Platform(
    name="meta",
    attention_backends=("torch_native",),
    distributed_backend="gloo",
    stages_inputs=False,
    pins_staging=False,
    graph_kind="none",
    profiles_memory=False,
    sets_threads=False,
    packs_weights=False,
    zeroes_lazily=False,
    serves_from_worker=False,
    builds_kernels_ahead=False,
    prefers_16bit=False,
)
_PLATFORMS = {p.name: p for p in (CPU, CUDA, META)}


def platform_for(device: torch.device | str) -> Platform:
    kind = torch.device(device).type
    if kind not in _PLATFORMS:
        raise ValueError(f"no platform for device {str(device)!r}; use 'cpu' or 'cuda[:N]'")
    return _PLATFORMS[kind]
