"""The Triton paged-attention kernel: one launch for a whole mixed batch.

One program per (token, KV head) of the padded batch, so the launch shape
depends only on the padded token count: the same launch serves any mix of
prefill chunks and decodes and can be captured in a FULL CUDA graph. Each
program finds its request by binary search over ``query_start_loc``, walks
that request's blocks through the block table with an online softmax, and
masks keys after its own position (and before its sliding window), after
soft-capping the scaled logits when the layer has a cap (Gemma 2). The
program computes every query head that shares its KV head together, so each
key block is loaded once per group.

On CPU tensors the kernel runs in Triton's interpreter, which needs
``TRITON_INTERPRET=1`` in the environment before triton is first imported
(Triton decides at decoration time, for its own library functions too); it
is slow and meant for tests. This file imports triton at the top and is only
imported when the triton backend runs.
"""

# No `from __future__ import annotations` here: Triton reads the kernel's
# parameter annotations (tl.constexpr) as objects.

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_reqs"])
def paged_attention_kernel(
    q_ptr,  # [tokens, heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_size]
    v_cache_ptr,  # same layout and strides as the key cache
    out_ptr,  # [tokens, heads, head_size]
    query_start_loc_ptr,  # [num_reqs + 1]
    seq_lens_ptr,  # [num_reqs]
    block_table_ptr,  # [>= num_reqs, max_blocks]
    num_reqs,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_req,
    QUERIES_PER_KV: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # QUERIES_PER_KV rounded up to a power of 2, >= 16 for tl.dot
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0 = none
    SOFT_CAP: tl.constexpr,  # logits -> SOFT_CAP * tanh(logits / SOFT_CAP); 0 = none
    PRECISION: tl.constexpr,  # tl.dot input precision; only matters for float32
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The token's request: the last one whose first token is <= token. Padded
    # requests start at the end of the real tokens, so real tokens never land
    # in them; padded tokens do, and see no keys (kv_end = 0 below).
    lo = num_reqs * 0
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        before = tl.load(query_start_loc_ptr + mid) <= token
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid)
    req = lo
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    num_actual_tokens = tl.load(query_start_loc_ptr + num_reqs)

    # Absolute position of this query token; it sees keys in [kv_start, kv_end).
    pos = seq_len - (q_end - q_start) + (token - q_start)
    kv_end = tl.where(token < num_actual_tokens, pos + 1, 0)
    kv_start = kv_end * 0
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(pos + 1 - SLIDING_WINDOW, 0)

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_s = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * QUERIES_PER_KV + offs_h
    d_mask = offs_d < HEAD_SIZE
    qo_mask = (offs_h < QUERIES_PER_KV)[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr
        + token.to(tl.int64) * stride_q_tok
        + heads[:, None] * stride_q_head
        + offs_d[None, :],
        mask=qo_mask,
        other=0.0,
    )

    m_i = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS_PAD], tl.float32)
    acc = tl.zeros([HEADS_PAD, HEAD_PAD], tl.float32)
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    for j in range(kv_start // BLOCK_SIZE, tl.cdiv(kv_end, BLOCK_SIZE)):
        block = tl.load(block_row + j).to(tl.int64)
        kv_pos = j * BLOCK_SIZE + offs_s
        kv_mask = (kv_pos >= kv_start) & (kv_pos < kv_end)
        kv_offs = (
            block * stride_c_block
            + offs_s[:, None] * stride_c_slot
            + kv_head * stride_c_head
            + offs_d[None, :]
        )
        load_mask = kv_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=load_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFT_CAP > 0:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both infinities, and runs in the
            # interpreter as well as on GPUs (tl has no portable tanh).
            s = SOFT_CAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFT_CAP) + 1.0))
        s = tl.where(kv_mask[None, :], s, float("-inf"))
        # Every visited block holds at least one visible key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs, mask=load_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Padded tokens saw no keys: l_i = 0, acc = 0, output 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + token.to(tl.int64) * stride_o_tok
        + heads[:, None] * stride_o_head
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=qo_mask,
    )


def _kernel_for(device: torch.device):
    """The kernel, checked to be able to run on ``device``."""
    if device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError(
            "the triton attention kernel runs on CPU tensors only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before triton is first imported"
        )
    return paged_attention_kernel


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(n))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Attention of every token of ``query`` [tokens, heads, d] over its request's cache."""
    num_tokens, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"the triton attention backend needs a power-of-2 block_size >= 16, got {block_size}"
        )
    if query.stride(2) != 1 or output.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("query, output and kv_cache need a contiguous last (head_size) dim")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    queries_per_kv = num_heads // num_kv_heads
    kernel = _kernel_for(query.device)
    kernel[(num_tokens, num_kv_heads)](
        query,
        k_cache,
        v_cache,
        output,
        query_start_loc,
        seq_lens,
        block_table,
        query_start_loc.shape[0] - 1,
        scale,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        HEADS_PAD=_pow2_at_least(queries_per_kv, 16),
        HEAD_SIZE=head_size,
        HEAD_PAD=_pow2_at_least(head_size, 16),
        BLOCK_SIZE=block_size,
        SLIDING_WINDOW=sliding_window or 0,
        SOFT_CAP=float(logits_soft_cap or 0.0),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
