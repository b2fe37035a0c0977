"""The fused ops: definitions, fake implementations, CPU and CUDA kernels.

Semantics are those of the model code the passes match (see
``compile_runtime/models/llama.py``), including where it rounds:

* ``rms_norm(x, weight, eps)`` is ``weight * (x32 * rsqrt(mean(x32 ** 2, -1) + eps)).to(x.dtype)``
  with ``x32 = x.float()``; the result has the promoted dtype of weight and x.
* ``fused_add_rms_norm(x, residual, weight, eps)`` returns ``(rms_norm(s, weight, eps), s)``
  with ``s = x + residual`` rounded to the inputs' dtype first.
* ``silu_and_mul(x)`` is ``silu(x[..., :d]) * x[..., d:]`` (silu rounded to x's dtype, as
  ``F.silu`` does).
* ``rotary_embedding_(positions, query, key, cos_cache, sin_cache)`` rotates query and key
  (``[tokens, heads, head_size]``, neox style: halves, not interleaved pairs) in place by
  the angles of ``positions``: ``cos_cache``/``sin_cache`` are ``[max_position, head_size // 2]``.
  The arithmetic runs in the promoted dtype of the tensor and the cache, and the result is
  rounded into the tensor, as ``cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin]).to(x.dtype)``.
  ``key`` may be None (rotate one tensor).

Outputs are freshly allocated and contiguous, whatever the input strides (the
fake implementations promise exactly that). The CPU path is plain PyTorch:
on a CPU, Inductor's own generated C++ for the unfused pattern is as good or
better (see benchmarks/passes.py), so the passes default to CUDA only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAMESPACE = "compile_runtime"
RMS_NORM = f"{NAMESPACE}::rms_norm"
FUSED_ADD_RMS_NORM = f"{NAMESPACE}::fused_add_rms_norm"
SILU_AND_MUL = f"{NAMESPACE}::silu_and_mul"
ROTARY_EMBEDDING = f"{NAMESPACE}::rotary_embedding_"


def _norm_out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype)


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm weight has shape {tuple(weight.shape)} but x's last dimension is "
            f"{x.shape[-1]}; the weight must be 1-D of that size"
        )


# ---- reference (CPU) implementations ---------------------------------------------


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm without a weight normalizes in float32 and rounds once to x's dtype:
    # exactly (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype), in one fused CPU kernel.
    normed = F.rms_norm(x, (x.shape[-1],), eps=eps)
    out = torch.empty(x.shape, dtype=_norm_out_dtype(x, weight), device=x.device)
    return torch.mul(weight, normed, out=out)


def _silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    return torch.mul(F.silu(x[..., :d]), x[..., d:], out=out)


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    x1.copy_(o1)
    x2.copy_(o2)


def _rotary_torch(positions, query, key, cos_cache, sin_cache) -> None:
    cos = cos_cache[positions].unsqueeze(-2)
    sin = sin_cache[positions].unsqueeze(-2)
    _rotate_torch(query, cos, sin)
    if key is not None:
        _rotate_torch(key, cos, sin)


# ---- the ops --------------------------------------------------------------------


@torch.library.custom_op(RMS_NORM, mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_norm(x, weight)
    if x.is_cuda:
        from compile_runtime.ops import triton_kernels

        return triton_kernels.rms_norm(x, weight, eps)
    return _rms_norm_torch(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=_norm_out_dtype(x, weight))


@torch.library.custom_op(FUSED_ADD_RMS_NORM, mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_norm(x, weight)
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"fused_add_rms_norm needs x and residual of one shape and dtype, got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
        )
    if x.is_cuda:
        from compile_runtime.ops import triton_kernels

        return triton_kernels.fused_add_rms_norm(x, residual, weight, eps)
    s = torch.add(x, residual, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))
    return _rms_norm_torch(s, weight, eps), s


@fused_add_rms_norm.register_fake
def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return x.new_empty(x.shape, dtype=_norm_out_dtype(x, weight)), x.new_empty(x.shape)


@torch.library.custom_op(SILU_AND_MUL, mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from compile_runtime.ops import triton_kernels

        return triton_kernels.silu_and_mul(x)
    return _silu_and_mul_torch(x)


@silu_and_mul.register_fake
def _silu_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op(ROTARY_EMBEDDING, mutates_args=("query", "key"))
def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    if 2 * cos_cache.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"rotary cache rows hold {cos_cache.shape[-1]} angles but head_size is "
            f"{query.shape[-1]}; expected head_size // 2 (full neox rotary)"
        )
    if query.is_cuda:
        from compile_runtime.ops import triton_kernels

        triton_kernels.rotary_embedding_(positions, query, key, cos_cache, sin_cache)
        return
    _rotary_torch(positions, query, key, cos_cache, sin_cache)


@rotary_embedding_.register_fake
def _rotary_embedding_fake(positions, query, key, cos_cache, sin_cache) -> None:
    return None
