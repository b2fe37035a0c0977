"""Attention backends: torch-native (reference), Triton, FlashInfer, and the registry."""

from __future__ import annotations

from compile_runtime.backends.attention.base import (
    AttentionBackend,
    AttentionBackendError,
    AttentionImpl,
)
from compile_runtime.backends.attention.registry import (
    backend_names,
    get_attn_backend,
    load_backend,
    min_cg_support,
    use_attn_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionBackendError",
    "AttentionImpl",
    "backend_names",
    "get_attn_backend",
    "load_backend",
    "min_cg_support",
    "use_attn_backend",
]
