"""A runner's start-up: the profiling forward, the KV cache it takes, and where the time went.

After the weights load, one forward runs at the largest step size (trace and compile,
or the saved program): the profiling forward. Its batch (``profile_metadata``) is
``max_num_tokens`` tokens as ``max_num_seqs`` short requests through the attention
backend the steps use, over a throwaway cache of two blocks, as vLLM's profile batch
is many short requests: every activation outside attention is that of the largest
step, and attention's own memory is what the backend takes for those tokens, but no
[T, T] logits or mask exist (attention without metadata would treat the T tokens as
one sequence: O(heads x T^2) floats, 8 GiB at 8k tokens and 32 heads on SDPA's math
kernel). Paged backends on CUDA (Triton, FlashInfer) are linear in the tokens
anyway, so a longer request of the same step takes no more. Then the KV cache gets
what is left: on CUDA this engine's share of the device less its weights and the
profile's activations (``kv_sizing.cuda_kv_budget``), on a CPU the byte budget; never
more blocks than the engine can ever use. The cache is then allocated and bound to
the attention layers. ``StartupTimes`` keeps the seconds and sizes for the one
start-up line users see.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from compile_runtime.attention.groups import MetadataGroups
from compile_runtime.attention.kv_cache import (
    PADDING_SLOT,
    allocate_kv_cache,
    bind_kv_cache,
    kv_cache_bytes_per_block,
    kv_cache_shape,
)
from compile_runtime.attention.metadata import build_metadata
from compile_runtime.compiler.decorator import load_saved_program
from compile_runtime.config import RunnerConfig
from compile_runtime.platforms.select import platform_for
from compile_runtime.worker.kv_sizing import (
    CudaMemory,
    blocks_per_request,
    cuda_kv_budget,
    most_blocks_needed,
)
from compile_runtime.worker.step_inputs import StepBuffers, profile_query_lens, query_start_loc

if TYPE_CHECKING:
    from compile_runtime.attention.layer import Attention


class ModelRunnerError(RuntimeError):
    """The runner cannot start (a KV cache too small) or was called out of order."""


@dataclass
class StartupTimes:
    """Where a runner's start-up went (seconds), for the one start-up line users see."""

    weights: float = 0.0  # build the model and load its weights
    first_forward: float = 0.0  # trace + compile, or load the saved program, + one forward
    compile: float = 0.0  # of which our backend: passes, split, compile or load the pieces
    saved_program: bool = False  # the first forward ran a saved program: no trace at all
    first_forward_tokens: int = 0  # its size (first_forward_tokens)
    kv_cache: float = 0.0
    graphs: float = 0.0  # graph capture (CUDA graphs, or CPU graphs on a CPU)
    graph_sizes: str = ""  # which sizes were captured in which mode (the capture report's)
    num_blocks: int = 0
    kv_cache_tokens: int = 0  # tokens the cache holds (the null block left out)
    kv_cache_bytes: int = 0

    @property
    def total(self) -> float:
        return self.weights + self.first_forward + self.kv_cache + self.graphs

    def summary(self) -> str:
        if self.saved_program:
            model = (
                f"saved program {self.first_forward:.2f} s (no trace, no compile, "
                f"{self.first_forward_tokens} tokens run)"
            )
        else:
            trace = max(self.first_forward - self.compile, 0.0)
            model = f"trace {trace:.2f} s, compile {self.compile:.2f} s"
        return (
            f"start-up {self.total:.2f} s: weights {self.weights:.2f} s, {model}, "
            f"KV cache {self.kv_cache:.2f} s ({self.kv_cache_bytes / 2**30:.2f} GiB, "
            f"{self.kv_cache_tokens} tokens in {self.num_blocks} blocks), "
            f"graphs {self.graphs:.2f} s" + (f" ({self.graph_sizes})" if self.graph_sizes else "")
        )


def allocated_bytes(device: torch.device) -> int:
    """Device memory torch holds now (0 off CUDA): the runner's own use is measured from it."""
    return platform_for(device).memory_allocated(device)


# The start-up's first forward on a CPU with a saved program: a few tokens, to run the
# program once (each size's own paths warm up at its first use: capture's warm-up at the
# largest size, or a lazily captured size's first step). On a 1B model 64 tokens took ~1 s.
FIRST_FORWARD_TOKENS = 8
# The first trace's size on a CPU, Inductor's size hint for the token dimension: the code
# it generated for SmolLM2's pieces at 256 tokens was that of 2048 (but for the example
# inputs of its benchmark harness).
CPU_TRACE_TOKENS = 256


def first_forward_tokens(
    model: torch.nn.Module,
    buffers: StepBuffers,
    max_num_tokens: int,
    profile: Callable[[int], contextlib.AbstractContextManager[Any]],
) -> int:
    """Tokens of the start-up's first forward: ``max_num_tokens`` (the profile of the largest
    step, and the first trace's size), but on a CPU, where no memory is profiled, a model
    with a saved program loads it and runs a small step, and one without traces at
    ``CPU_TRACE_TOKENS``: not seconds of a 2-core prefill (a 2048-token step of a 1B model
    took ~15 s). ``profile(n)``: the first forward's context (``profile_metadata``), where
    the program's key is what the forward's will be."""
    if platform_for(buffers.device).profiles_memory:
        return max_num_tokens
    with profile(max_num_tokens), torch.inference_mode():
        found = load_saved_program(model, *buffers.forward_args(max_num_tokens))
    return min(max_num_tokens, FIRST_FORWARD_TOKENS if found else CPU_TRACE_TOKENS)


@contextlib.contextmanager
def profile_metadata(
    layers: Sequence[Attention],
    groups: MetadataGroups,
    slot_mapping: torch.Tensor,
    config: RunnerConfig,
    num_tokens: int,
    max_blocks_per_req: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Iterator[Any]:
    """``with profile_metadata(...) as metadata:`` the profiling forward's attention metadata:
    ``num_tokens`` in ``max_num_seqs`` requests (``profile_query_lens``) reading block 1 and
    writing the null block (``slot_mapping``, a view of the runner's buffer, is set to -1)
    of a two-block cache bound to ``layers`` until the block ends."""
    query_lens = profile_query_lens(num_tokens, config.max_num_seqs)
    for layer in layers:
        shape = kv_cache_shape(2, config.block_size, layer.num_kv_heads, layer.head_size)
        layer.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    slots = slot_mapping[:num_tokens]
    slots.fill_(PADDING_SLOT)
    block_table = torch.ones(
        (len(query_lens), max_blocks_per_req), dtype=torch.int32, device=device
    )
    try:
        yield build_metadata(
            groups,
            query_start_loc(np.cumsum(query_lens)),
            torch.from_numpy(query_lens),
            block_table,
            slots,
            num_tokens,
        )
    finally:
        for layer in layers:
            layer.kv_cache = None


def allocate_kv_cache_for(
    config: RunnerConfig,
    layers: Sequence[Attention],
    dtype: torch.dtype,
    device: torch.device,
    allocated_at_start: int,
    times: StartupTimes,
) -> int:
    """Size the KV cache for what is left after the first forward, allocate it and bind it to
    the layers; its blocks (``times`` gets the seconds and sizes)."""
    start = time.perf_counter()
    num_blocks = times.num_blocks = num_kv_blocks(config, layers, dtype, device, allocated_at_start)
    times.kv_cache_bytes = bind_new_kv_cache(layers, num_blocks, config.block_size, dtype, device)
    times.kv_cache = time.perf_counter() - start
    times.kv_cache_tokens = (num_blocks - 1) * config.block_size
    return num_blocks


def num_kv_blocks(
    config: RunnerConfig,
    layers: Sequence[Attention],
    dtype: torch.dtype,
    device: torch.device,
    allocated_at_start: int,
) -> int:
    """Blocks for the budget (after the profiling forward), capped at what can ever be used."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    per_block = kv_cache_bytes_per_block(layers, config.block_size, dtype)
    platform = platform_for(device)
    if platform.profiles_memory:
        platform.synchronize(device)
        platform.release_cached_memory()  # the profile's activations count as free
        free, total = torch.cuda.mem_get_info(device)
        peak = torch.cuda.max_memory_allocated(device)
        memory = CudaMemory(
            total=total,
            free=free,
            own_peak=peak - allocated_at_start,
            activations=peak - allocated_bytes(device),
        )
        budget = cuda_kv_budget(memory, config.gpu_memory_utilization)
    else:
        budget = config.kv_cache_bytes
    max_len, block_size = config.max_model_len, config.block_size
    num_blocks = min(
        budget // per_block, most_blocks_needed(config.max_num_seqs, max_len, block_size)
    )
    needed = blocks_per_request(max_len, block_size) + 1
    if num_blocks < needed:
        raise ModelRunnerError(
            f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {num_blocks} blocks of "
            f"{block_size} tokens; one request of max_model_len={max_len} needs "
            f"{needed}. Raise kv_cache_bytes (--kv-cache-bytes) / gpu_memory_utilization or lower "
            f"max_model_len (--max-model-len)"
        )
    return int(num_blocks)


def bind_new_kv_cache(
    layers: Sequence[Attention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Allocate the cache and bind it to the layers; its bytes (layers may share a cache)."""
    caches = allocate_kv_cache(layers, num_blocks, block_size, dtype=dtype, device=device)
    bind_kv_cache(layers, caches)
    unique = {id(t): t for t in caches.values()}.values()
    return sum(t.numel() * t.element_size() for t in unique)
