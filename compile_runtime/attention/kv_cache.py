"""The paged KV cache: layout, allocation, binding to layers, and writes.

Layout of one cache tensor (per layer, or shared by a group of layers)::

    [2, num_blocks, block_size, num_kv_heads, head_size]
     ^ 0 = keys, 1 = values

A token's *slot* is ``block_id * block_size + offset``. Block 0 is the null
block: never handed to a request, it absorbs the writes of padded tokens (slot
-1 is redirected there) so that a padded batch writes at fixed addresses
without data-dependent masking, which keeps the write capturable in a CUDA
graph. Its contents are garbage by design and nothing valid ever reads it.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from compile_runtime.platforms.select import platform_for

logger = logging.getLogger(__name__)


class Attention(Protocol):
    """What the cache reads of an attention layer (``layer.py``), and the one field it sets."""

    layer_name: str
    num_kv_heads: int
    head_size: int
    kv_cache: torch.Tensor | None


NULL_BLOCK_ID = 0
PADDING_SLOT = -1


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int, int, int]:
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def kv_cache_bytes_per_block(
    layers: Iterable[Attention], block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block costs across ``layers`` (for sizing ``num_blocks`` from free memory)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_size * itemsize for layer in layers)


def allocate_kv_cache(
    layers: Iterable[Attention],
    num_blocks: int,
    block_size: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    shared: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """One zeroed cache tensor per layer name.

    ``shared`` maps a layer name to the name of the layer whose cache it reuses
    (cross-layer KV sharing); such layers get the same tensor object.
    """
    if num_blocks < 2:
        raise ValueError(
            f"num_blocks={num_blocks}: need at least 2 (block {NULL_BLOCK_ID} is the null block)"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    dtype = dtype or torch.get_default_dtype()
    shared = dict(shared or {})
    layers = list(layers)
    by_name = {layer.layer_name: layer for layer in layers}
    caches: dict[str, torch.Tensor] = {}
    for layer in layers:
        if layer.layer_name in shared:
            continue
        shape = kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        caches[layer.layer_name] = _zeros(shape, dtype, device)
    for name, target in shared.items():
        if target not in caches:
            raise ValueError(
                f"layer {name!r} shares the KV cache of {target!r}, which is not an allocated "
                f"layer; known layers: {sorted(caches)}"
            )
        if name in by_name:
            _check_shape(by_name[name], caches[target])
        caches[name] = caches[target]
    logger.info(
        "allocated KV cache: %d tensors, %d blocks of %d tokens, %.1f MiB",
        len({id(t) for t in caches.values()}),
        num_blocks,
        block_size,
        sum(t.numel() * t.element_size() for t in {id(t): t for t in caches.values()}.values())
        / 2**20,
    )
    return caches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed cache tensor. On a CPU, anonymous memory the kernel zeroes page by page on
    first touch: a cache sized from the machine's RAM costs no time at start-up and no
    memory until requests fill it (``torch.zeros`` writes every byte up front: seconds for
    a few GiB)."""
    if not platform_for(device or "cpu").zeroes_lazily:
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)  # the tensor keeps it alive
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def _check_shape(layer: Attention, cache: torch.Tensor) -> None:
    if (
        cache.dim() != 5
        or cache.shape[0] != 2
        or cache.shape[3] != layer.num_kv_heads
        or cache.shape[4] != layer.head_size
    ):
        raise ValueError(
            f"KV cache for {layer.layer_name!r} has shape {tuple(cache.shape)}; expected "
            f"[2, num_blocks, block_size, {layer.num_kv_heads}, {layer.head_size}]"
        )


def bind_kv_cache(layers: Iterable[Attention], kv_caches: Mapping[str, torch.Tensor]) -> None:
    """Give every layer its cache tensor (``layer.kv_cache``), checked against its shape."""
    for layer in layers:
        if layer.layer_name not in kv_caches:
            raise KeyError(f"no KV cache for layer {layer.layer_name!r}; have {sorted(kv_caches)}")
        cache = kv_caches[layer.layer_name]
        _check_shape(layer, cache)
        layer.kv_cache = cache


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's key and value [tokens, kv_heads, head_size] at its slot.

    Tokens past ``len(slot_mapping)`` are not written; slot -1 goes to the null
    block. Static shapes and no host sync, so this can run inside a CUDA graph.
    """
    n = min(key.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].clamp(min=0).to(torch.long)
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    kv_cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, slots, key[:n].to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_size).index_copy_(
        0, slots, value[:n].to(kv_cache.dtype)
    )


def compute_slot_mapping(
    block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Slot of each token from its request row and position: block_table[r, p // bs] * bs + p % bs."""
    req_indices = req_indices.to(torch.long)
    positions = positions.to(torch.long)
    blocks = block_table[req_indices, positions // block_size].to(torch.long)
    return blocks * block_size + positions % block_size
