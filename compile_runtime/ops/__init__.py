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

CPU linear layers: ``cpu_linear`` (the op: the kernels a float weight can run by and
which one runs a call; each layer's weight processed once after loading), ``kernel_tuning`` (that choice measured on this CPU, cached), ``packed_weights`` (the one record of what
processing made of a weight, found by the op), ``cpu_gemv`` and ``cpu_amx`` (C kernels for
float weights), ``c_library`` (builds them from ``csrc/``, typed by ``c_header`` from their
headers), ``native_function`` (a C function a CPU graph can record), ``hugepages`` (weights
moved into huge pages); quantized weights: ``cpu_quant_formats`` (GGUF's Q8_0/Q4_0/Q4_1
blocks in the kernels' layout), ``cpu_quant_gemm`` (the int8 VNNI kernel),
``cpu_quant_embedding`` (lookups that dequantize only their rows); ``cpu_lora`` (each
token's LoRA adapter added to a linear layer's output, the C kernel of ``csrc/lora.c``).
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
