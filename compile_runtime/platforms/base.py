"""``Platform``: the engine's device-dependent choices as data, so code asks the platform
instead of testing ``device.type`` itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    name: str  # the torch device type: "cpu" or "cuda"
    # Attention backends tried in order when none is named (compile_runtime/attention/selector.py).
    attention_backends: tuple[str, ...]
    distributed_backend: str  # torch.distributed's backend for this device's ranks
    # Step inputs are written to host buffers, then copied (non-blocking) to the device;
    # on a CPU the host buffers are the inputs themselves.
    stages_inputs: bool
    pins_staging: bool  # those host buffers are pinned (a CPU "copy" is a memcpy: no pinning)
    # What the graph wrappers capture: CUDA graphs, or CPU graphs of recorded native calls.
    graph_kind: str
    # Start-up profiles the largest step's memory, and the KV cache gets the device memory
    # left after it and the weights; without it (a CPU) the budget is a share of free RAM.
    profiles_memory: bool
    sets_threads: bool  # the engine chooses torch's intra-op thread count
    packs_weights: bool  # weights are repacked for native kernels and saved packed

    def memory_allocated(self, device: torch.device) -> int:
        """Bytes torch's allocator holds on ``device`` (0 where it does not track them)."""
        return torch.cuda.memory_allocated(device) if self.name == "cuda" else 0

    def step_event(self) -> torch.cuda.Event | None:
        """An event that marks a step's host-to-device copies, where copies are async."""
        return torch.cuda.Event() if self.name == "cuda" else None
