"""Dense causal attention of one sequence: the math every paged backend must match.

Used by ``torch_native`` per request (over keys gathered from the cache) and
by ``Attention`` when there is no step metadata (no cache at all).
``masked_attention`` is SDPA, or the same math written out when the logits
are soft-capped (SDPA has no soft cap); backends built on SDPA call it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's logit soft-capping: ``cap * tanh(scores / cap)``, bounded to (-cap, cap)."""
    return torch.tanh(scores / cap) * cap


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    logits_soft_cap: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with an optional soft cap on the scaled logits.

    Layout as SDPA's: query [..., heads, q, d], key/value [..., kv_heads, k, d],
    attn_mask bool (True = visible) broadcastable to [..., heads, q, k]. Capped
    logits and the softmax are computed in float32, as transformers does.
    """
    if logits_soft_cap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa
        )
    groups = query.shape[-3] // key.shape[-3]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scores = soft_cap((query @ key.transpose(-1, -2)).float() * scale, logits_soft_cap)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return scores.softmax(-1).to(value.dtype) @ value


def dense_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence whose last ``len(query)`` tokens are the queries.

    query [q_len, heads, d]; key/value [kv_len, kv_heads, d] with kv_len >= q_len.
    Query i sits at position kv_len - q_len + i and sees keys at positions
    <= its own (and > its own - sliding_window when a window is set).
    """
    q_len, kv_len = query.shape[0], key.shape[0]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
    k_pos = torch.arange(kv_len, device=query.device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = masked_attention(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        mask,
        scale,
        logits_soft_cap,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out[0].transpose(0, 1)
