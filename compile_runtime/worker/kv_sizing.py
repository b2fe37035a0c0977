"""How many KV-cache blocks a runner allocates.

Never more than the engine can ever use: ``max_num_seqs`` requests of
``max_model_len`` tokens each (plus the null block). A tiny model on a big GPU
would otherwise take the whole device, leaving nothing for a second engine in
the process, and its block pool would track millions of blocks nobody needs.
Within that, the memory budget decides: on a CPU ``kv_cache_bytes`` (by default a
fraction of the RAM available at start-up), on CUDA this engine's share of the
device (``gpu_memory_utilization``) minus what its own weights and activations
took, never more than is free. ``max_model_len`` left unset is the model's
positions, capped by what the CPU budget holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from compile_runtime.config import ConfigError, RunnerConfig
from compile_runtime.models.llama import head_size_of
from compile_runtime.platforms.select import platform_for

logger = logging.getLogger(__name__)


def blocks_per_request(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def most_blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that let every request of a full batch reach ``max_model_len``, null block included."""
    return max_num_seqs * blocks_per_request(max_model_len, block_size) + 1


@dataclass(frozen=True)
class CudaMemory:
    """What the runner measured after loading its weights and the profiling forward (one
    forward at the largest step size, ``startup.profile_metadata``)."""

    total: int  # device memory
    free: int  # free on the device now (other processes and engines subtracted)
    own_peak: int  # this runner's peak allocation: weights + the profile's activations
    activations: int  # the profile's activations: freed now (so in ``free``), needed by steps


def cuda_kv_budget(memory: CudaMemory, gpu_memory_utilization: float) -> int:
    """Bytes for the KV cache: this engine's share less its own peak, within what is free
    less the activations.

    Each term counts the activations once: ``own_peak`` holds them, and ``free``
    holds them too (freed after the profile) while every step needs them again. The
    CUDA graphs captured after the cache take their pool on top, from the device's
    remaining ``1 - gpu_memory_utilization``, as in vLLM's accounting (the pool holds
    the activations of the largest capture size, usually well below a step of
    ``max_num_tokens``).
    """
    share = int(memory.total * gpu_memory_utilization) - memory.own_peak
    return max(0, min(share, memory.free - memory.activations))


def kv_bytes_per_token(
    hf_config: Any, dtype: torch.dtype, tp_size: int = 1, pp_size: int = 1
) -> int:
    """Bytes one token's keys and values take on one rank, from the model's config (under
    pipeline parallelism on the stage with the most layers of an even split)."""
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_size = head_size_of(hf_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = -(-hf_config.num_hidden_layers // pp_size)
    return layers * 2 * -(-kv_heads // tp_size) * head_size * itemsize


def available_memory() -> int:
    """Bytes of RAM the kernel says a new allocation can take (MemAvailable), within a cgroup
    limit where one is set."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            available = min(available, int(limit) - used)
    return max(available, 0)


def size_runner_config(
    config: RunnerConfig,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_size: int = 1,
    pp_size: int = 1,
) -> RunnerConfig:
    """``config`` with the sizes left to the engine (None) decided, saying why in the log.

    Run once by the driver before any worker starts, so every rank gets the same sizes; the
    runner decides none (``RunnerConfig.check_decided``): one built alone gets a config
    sized here first.
    """
    on_cpu = not platform_for(device).profiles_memory
    kv_cache_bytes = config.kv_cache_bytes
    if on_cpu and kv_cache_bytes is None:
        available = available_memory()
        ranks = tp_size * pp_size  # every rank of the engine on this machine
        kv_cache_bytes = max(int(available * config.kv_cache_memory_fraction) // ranks, 1)
        logger.info(
            "KV cache budget %.2f GiB per rank: kv_cache_memory_fraction=%.2f of %.1f GiB "
            "available RAM (set kv_cache_bytes / --kv-cache-bytes to choose)",
            kv_cache_bytes / 2**30,
            config.kv_cache_memory_fraction,
            available / 2**30,
        )
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = _max_model_len(
            config, kv_cache_bytes, hf_config, dtype, on_cpu, tp_size, pp_size
        )
    if (kv_cache_bytes, max_model_len) == (config.kv_cache_bytes, config.max_model_len):
        return config
    return config.model_copy(
        update={"kv_cache_bytes": kv_cache_bytes, "max_model_len": max_model_len}
    )


def _max_model_len(
    config: RunnerConfig,
    kv_cache_bytes: int | None,
    hf_config: Any,
    dtype: torch.dtype,
    on_cpu: bool,
    tp_size: int,
    pp_size: int,
) -> int:
    """The model's positions, or on a CPU what the KV cache budget holds when that is less."""
    positions = getattr(hf_config, "max_position_embeddings", None) or 2048
    if not on_cpu:  # the budget is known only after the weights load; the runner checks it
        logger.info("max_model_len=%d: the model's max_position_embeddings", positions)
        return positions
    per_block = kv_bytes_per_token(hf_config, dtype, tp_size, pp_size) * config.block_size
    tokens = (kv_cache_bytes // per_block - 1) * config.block_size  # less the null block
    if tokens >= positions:
        logger.info("max_model_len=%d: the model's max_position_embeddings", positions)
        return positions
    if tokens >= config.block_size:
        logger.warning(
            "max_model_len=%d, below the model's %d positions: that is all a KV cache of "
            "%.2f GiB holds; raise kv_cache_bytes (--kv-cache-bytes) for longer requests",
            tokens,
            positions,
            kv_cache_bytes / 2**30,
        )
        return tokens
    raise ConfigError(
        f"a KV cache of {kv_cache_bytes} bytes holds no full block of "
        f"{config.block_size} tokens of this model ({per_block} bytes a block); raise "
        "kv_cache_bytes (--kv-cache-bytes) or kv_cache_memory_fraction"
    )
