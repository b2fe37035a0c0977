"""Attention backends: implementations of ``compile_runtime/attention/backend.py``'s
interface, chosen by ``compile_runtime/attention/selector.py`` (which imports them by name,
so nothing below this package depends on it).

* ``torch_native``: the per-request reference every other backend is tested against;
* the CPU default, ``cpu_batched``, lives with the CPU platform (``compile_runtime/cpu/``);
* ``triton_attn`` (+ ``triton_kernel``): one kernel for mixed batches, FULL graphs always;
* ``flashinfer_attn``: FlashInfer's wrappers, planned once per step.
"""

from __future__ import annotations

from compile_runtime.attention.backend import (
    AttentionBackend,
    AttentionBackendError,
    AttentionImpl,
)
from compile_runtime.attention.selector import (
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
