"""Attention backends, chosen by ``registry``.

* ``base``: what a backend declares, and ``AttentionImpl.forward``, the one owner of the
  step's cache write and of the output's padding rows (impls only ``compute``);
* ``torch_native``: the per-request reference every other backend is tested against;
* ``cpu_batched`` (+ ``cpu_batched_plan``, its host plan, and ``cpu_decode_kernel``, its C
  decode kernel): the CPU default;
* ``triton_attn`` (+ ``triton_kernel``): one kernel for mixed batches, FULL graphs always;
* ``flashinfer_attn``: FlashInfer's wrappers, planned once per step.
"""

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
