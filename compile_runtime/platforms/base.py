"""``Platform``: the engine's device-dependent choices, so code asks the platform instead of
testing ``device.type`` itself. The facts are fields; the calls into a device's runtime
(CUDA's memory and stream APIs) are methods that do nothing where a device has none."""

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
    # The KV cache is left to the OS to zero page by page on first touch (no start-up cost).
    zeroes_lazily: bool
    # The server runs the model in a worker process by default: on a CPU the step loop and
    # the HTTP front end would otherwise share one GIL and the same cores.
    serves_from_worker: bool
    builds_kernels_ahead: bool  # the native C kernels build in the background from LLM()
    # dtype="auto" runs 16-bit whatever the checkpoint (a CPU decides by its bf16 support).
    prefers_16bit: bool

    def available(self) -> bool:
        return self.name != "cuda" or torch.cuda.is_available()

    def device_count(self) -> int:
        if self.name != "cuda":
            return 1
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def identity(self, device: torch.device) -> str:
        """What compiled code depends on: ``cuda:sm_<cc>:<name>`` or ``cpu:<ISA>``."""
        if self.name == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device)
            return f"cuda:sm_{major}{minor}:{torch.cuda.get_device_name(device)}"
        return f"cpu:{torch.backends.cpu.get_cpu_capability()}"

    def set_device(self, device: torch.device) -> None:
        if self.name == "cuda" and device.index is not None:
            torch.cuda.set_device(device)

    def synchronize(self, device: torch.device | None = None) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize(device)

    def release_cached_memory(self) -> None:
        """Give the allocator's cached, unused blocks back (CUDA's caching allocator)."""
        if self.name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device: torch.device) -> int:
        """Bytes torch's allocator holds on ``device`` (0 where it does not track them)."""
        return torch.cuda.memory_allocated(device) if self.name == "cuda" else 0

    def reset_peak_memory(self, device: torch.device) -> None:
        if self.name == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def step_event(self) -> torch.cuda.Event | None:
        """An event that marks a step's host-to-device copies, where copies are async."""
        return torch.cuda.Event() if self.name == "cuda" else None

    def rank_device(self, device: str, local_rank: int) -> str:
        """The device of one of several ranks on this machine: each its own GPU when the
        engine names CUDA without an index; ranks share a CPU."""
        if self.name == "cuda" and torch.device(device).index is None:
            return f"cuda:{local_rank}"
        return device

    def missing_device(self, device: torch.device, ranks: int = 1) -> str | None:
        """Why ``ranks`` ranks cannot run on ``device`` here (None: they can)."""
        if self.name != "cuda":
            return None
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
            return f"CUDA is not available here (torch {torch.__version__}, a {build} build)"
        last = device.index if device.index is not None else ranks - 1
        if last >= (count := self.device_count()):
            return f"it needs GPU {last}, but this machine has {count}"
        return None
