"""How many KV-cache blocks a runner allocates.

Never more than the engine can ever use: ``max_num_seqs`` requests of
``max_model_len`` tokens each (plus the null block). A tiny model on a big GPU
would otherwise take the whole device, leaving nothing for a second engine in
the process, and its block pool would track millions of blocks nobody needs.
Within that, the memory budget decides: on a CPU ``kv_cache_bytes``, on CUDA
this engine's share of the device (``gpu_memory_utilization``) minus what its
own weights and activations took, never more than is free.
"""

from __future__ import annotations

from dataclasses import dataclass


def blocks_per_request(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def most_blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that let every request of a full batch reach ``max_model_len``, null block included."""
    return max_num_seqs * blocks_per_request(max_model_len, block_size) + 1


@dataclass(frozen=True)
class CudaMemory:
    """What the runner measured after loading its weights and one forward at the largest size."""

    total: int  # device memory
    free: int  # free on the device now (other processes and engines subtracted)
    own_peak: int  # this runner's peak allocation: weights + the largest forward's activations
    activations: int  # the largest forward's activations (a CUDA graph pool needs as much)


def cuda_kv_budget(memory: CudaMemory, gpu_memory_utilization: float) -> int:
    """Bytes for the KV cache: this engine's share minus its own use, within what is free.

    The graphs captured after the cache is allocated need about one forward's
    activations, so that is held back from both.
    """
    share = int(memory.total * gpu_memory_utilization) - memory.own_peak - memory.activations
    return max(0, min(share, memory.free - memory.activations))
