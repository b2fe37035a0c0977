"""Triton kernels for the fused ops (CUDA; on CPU tensors under ``TRITON_INTERPRET=1``).

Each kernel reproduces the rounding of the unfused model code: sums and
products run in float32, and a value is rounded to the tensor dtype wherever
the PyTorch code it replaces would hold it in that dtype. One program handles
one row (norms), one row block (silu_and_mul) or one (token, head) pair
(rotary), so the launch shape depends only on the token count and a launch can
be captured in a CUDA graph.

Triton decides whether to interpret when it is first imported; this module
imports it at the top and is only imported when a kernel is about to run.
"""

# No `from __future__ import annotations`: Triton reads tl.constexpr annotations as objects.

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # The residual sum is held in the input dtype before the norm reads it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _norm(x, residual, weight, eps):
    n_cols = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, n_cols)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out2 = res_out.view(-1, n_cols)
    else:
        r2, res_out, res_out2 = x2, None, out2
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out2,
            res_out2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            res_out2.stride(0),
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n_cols),
        )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight.contiguous(), eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight.contiguous(), eps)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # F.silu rounds to the input dtype
    out = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    block = min(1024, triton.next_power_of_2(d))
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block
        )
    return out


@triton.jit
def _rotate_head(ptr, cos, sin, offs, mask, half, COMPUTE: tl.constexpr):
    x1 = tl.load(ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(ptr + half + offs, mask=mask, other=0.0)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # Each product and sum is rounded to the compute dtype, as the unfused ops would hold it.
    a = (x1 * cos).to(COMPUTE).to(tl.float32)
    b = (x2 * sin).to(COMPUTE).to(tl.float32)
    c = (x2 * cos).to(COMPUTE).to(tl.float32)
    d = (x1 * sin).to(COMPUTE).to(tl.float32)
    o1 = (a - b).to(COMPUTE)
    o2 = (c + d).to(COMPUTE)
    tl.store(ptr + offs, o1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + half + offs, o2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    half,
    HAS_KEY: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
    if head < num_q_heads:
        q = q_ptr + tok * stride_q_tok + head * stride_q_head
        _rotate_head(q, cos, sin, offs, mask, half, COMPUTE)
    if HAS_KEY:
        if head < num_k_heads:
            k = k_ptr + tok * stride_k_tok + head * stride_k_head
            _rotate_head(k, cos, sin, offs, mask, half, COMPUTE)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    for t in (query, key):
        if t is not None and (t.dim() != 3 or t.stride(-1) != 1):
            raise ValueError(
                f"rotary_embedding_ takes [tokens, heads, head_size] tensors with a unit last "
                f"stride, got shape {tuple(t.shape)} strides {t.stride()}"
            )
    num_tokens, half = query.shape[0], cos_cache.shape[-1]
    if num_tokens == 0:
        return
    compute = torch.promote_types(query.dtype, cos_cache.dtype)
    k = key if key is not None else query
    cos, sin = cos_cache.contiguous(), sin_cache.contiguous()
    grid = (num_tokens, max(query.shape[1], key.shape[1] if key is not None else 0))
    _rotary_kernel[grid](
        positions.contiguous(),
        query,
        k,
        cos,
        sin,
        query.stride(0),
        query.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        query.shape[1],
        k.shape[1],
        half,
        HAS_KEY=key is not None,
        COMPUTE=_TL_DTYPES[compute],
        BLOCK=triton.next_power_of_2(half),
    )
