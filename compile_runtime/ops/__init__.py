"""Fused custom ops that the graph passes put in place of common patterns (``fused``).

Each op is a ``torch.library`` custom op with a fake (meta) implementation, a
Triton kernel on CUDA (``triton_kernels``) and a plain PyTorch implementation
elsewhere. They compute exactly what the unfused model code computes, rounding
included: the passes replace a pattern only by an op of identical semantics.

    torch.ops.compile_runtime.rms_norm(x, weight, eps)
    torch.ops.compile_runtime.fused_add_rms_norm(x, residual, weight, eps) -> (out, x + residual)
    torch.ops.compile_runtime.silu_and_mul(x)             # silu(x[..., :d]) * x[..., d:]
    torch.ops.compile_runtime.rotary_embedding_(positions, query, key, cos_cache, sin_cache)
                                                          # in place on query and key

The CPU's own kernels (linear layers, quantized weights, LoRA, attention, CPU graphs)
live with the rest of the CPU platform in ``compile_runtime/cpu/``.
"""

from __future__ import annotations

from compile_runtime.ops.fused import (
    FUSED_ADD_RMS_NORM,
    RMS_NORM,
    ROTARY_EMBEDDING,
    SILU_AND_MUL,
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding_,
    silu_and_mul,
)

__all__ = [
    "FUSED_ADD_RMS_NORM",
    "RMS_NORM",
    "ROTARY_EMBEDDING",
    "SILU_AND_MUL",
    "fused_add_rms_norm",
    "rms_norm",
    "rotary_embedding_",
    "silu_and_mul",
]
