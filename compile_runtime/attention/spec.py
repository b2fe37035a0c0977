"""What an attention layer is, independent of any backend.

Backends and metadata builders receive this instead of the layer, so they
never depend on ``nn.Module`` code and layers with the same spec can share a
builder (one ``plan()`` per step for all of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    # Each query sees itself and the ``sliding_window - 1`` tokens before it.
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    # Scaled logits become ``cap * tanh(logits / cap)`` before masking and softmax (Gemma 2).
    logits_soft_cap: float | None = None
    # Query heads per KV head (grouped-query attention): decided here, read at every step.
    num_queries_per_kv: int = field(init=False)

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_size <= 0:
            raise ValueError(
                f"num_heads ({self.num_heads}), num_kv_heads ({self.num_kv_heads}) and "
                f"head_size ({self.head_size}) must be positive"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
            raise ValueError(
                f"logits_soft_cap must be positive or None, got {self.logits_soft_cap}"
            )
        object.__setattr__(self, "num_queries_per_kv", self.num_heads // self.num_kv_heads)
