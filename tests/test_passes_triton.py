"""The fused ops' Triton kernels against the PyTorch implementations, in Triton's interpreter.

Triton decides whether to interpret when it is first imported, so an ordinary
run cannot switch it on: ``test_kernels_in_interpreter`` re-runs this module
in a subprocess with ``TRITON_INTERPRET=1``, where the cases run (they skip
here). On CUDA the same cases run on the GPU.

The interpreter rounds float32 to bfloat16/float16 by truncation, not to
nearest even as GPUs do, so low-precision results may differ by one unit in
the last place there; float32 results must match to float32 precision.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from triton_interpreter import run_interpreted

from compile_runtime.ops.fused import (
    _rms_norm_torch,
    _rotary_torch,
    _silu_and_mul_torch,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    not (INTERPRETING or torch.cuda.is_available()),
    reason="runs in the TRITON_INTERPRET=1 subprocess (or on CUDA)",
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tolerance(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    # One unit in the last place, relative (the interpreter truncates).
    return dict(atol=1e-2, rtol=2 * torch.finfo(dtype).eps)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(INTERPRETING or torch.cuda.is_available(), reason="kernels run directly")
@pytest.mark.slow
def test_kernels_in_interpreter():
    run_interpreted(__file__, skip_reason="runs in the TRITON_INTERPRET=1 subprocess")


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 48), (1, 100)])
def test_rms_norm_kernels(dtype, shape):
    from compile_runtime.ops import triton_kernels

    x, r, w = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype, seed=1), rand(shape[-1], seed=2)
    w = w.to(dtype)
    torch.testing.assert_close(
        triton_kernels.rms_norm(x, w, 1e-6), _rms_norm_torch(x, w, 1e-6), **tolerance(dtype)
    )
    out, summed = triton_kernels.fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(summed, x + r, **tolerance(dtype))
    torch.testing.assert_close(out, _rms_norm_torch(x + r, w, 1e-5), **tolerance(dtype))


@needs_kernels
def test_rms_norm_kernel_with_a_float32_weight_and_strided_rows():
    from compile_runtime.ops import triton_kernels

    qkv = rand(9, 3 * 64, dtype=torch.bfloat16)
    q = qkv[:, :64].view(9, 4, 16)  # rows of a head, not contiguous across tokens
    w = rand(16, seed=3)
    out = triton_kernels.rms_norm(q, w, 1e-6)
    assert out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, _rms_norm_torch(q, w, 1e-6), **tolerance(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 48), (2, 3, 2 * 1100)])
def test_silu_and_mul_kernel(dtype, shape):
    from compile_runtime.ops import triton_kernels

    x = rand(*shape, dtype=dtype)
    torch.testing.assert_close(
        triton_kernels.silu_and_mul(x), _silu_and_mul_torch(x), **tolerance(dtype)
    )


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", ["float32", "same"])
def test_rotary_kernel_in_place_on_views_of_qkv(dtype, cache_dtype):
    from compile_runtime.ops import triton_kernels

    n, heads, kv_heads, d = 6, 4, 2, 16
    cache_dtype = torch.float32 if cache_dtype == "float32" else dtype
    cos, sin = (
        rand(40, d // 2, dtype=cache_dtype, seed=4),
        rand(40, d // 2, dtype=cache_dtype, seed=5),
    )
    positions = torch.tensor([0, 5, 3, 39, 1, 2], device=DEVICE)
    qkv = rand(n, (heads + 2 * kv_heads) * d, dtype=dtype)
    expected = qkv.clone()
    eq = expected[:, : heads * d].view(n, heads, d)
    ek = expected[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
    _rotary_torch(positions, eq, ek, cos, sin)

    q = qkv[:, : heads * d].view(n, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    triton_kernels.rotary_embedding_(positions, q, k, cos, sin)
    torch.testing.assert_close(qkv, expected, **tolerance(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched

    q_only = rand(n, heads, d, dtype=dtype, seed=6)
    expected_q = q_only.clone()
    _rotary_torch(positions, expected_q, None, cos, sin)
    triton_kernels.rotary_embedding_(positions, q_only, None, cos, sin)
    torch.testing.assert_close(q_only, expected_q, **tolerance(dtype))
