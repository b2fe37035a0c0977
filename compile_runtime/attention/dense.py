"""Dense causal attention of one sequence: the math every paged backend must match.

Used by ``torch_native`` per request (over keys gathered from the cache) and
by ``Attention`` when there is no step metadata (no cache at all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
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
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out[0].transpose(0, 1)
