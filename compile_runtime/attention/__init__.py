"""Attention: the layer, per-step metadata, and the paged KV cache."""

from __future__ import annotations

from compile_runtime.attention.kv_cache import (
    NULL_BLOCK_ID,
    allocate_kv_cache,
    bind_kv_cache,
    compute_slot_mapping,
    kv_cache_bytes_per_block,
    kv_cache_shape,
    write_kv_cache,
)
from compile_runtime.attention.layer import Attention, attention_layers
from compile_runtime.attention.metadata import (
    AttentionMetadata,
    AttentionMetadataBuilder,
    MetadataError,
)
from compile_runtime.attention.spec import AttentionSpec

__all__ = [
    "NULL_BLOCK_ID",
    "Attention",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "MetadataError",
    "allocate_kv_cache",
    "attention_layers",
    "bind_kv_cache",
    "compute_slot_mapping",
    "kv_cache_bytes_per_block",
    "kv_cache_shape",
    "write_kv_cache",
]
