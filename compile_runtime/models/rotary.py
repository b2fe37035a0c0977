"""Rotary position embedding for the native decoder: the frequencies transformers computes
for a config (every rope type through transformers' own initialisers), as one cos/sin
table indexed by position."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from compile_runtime.models.loader import NativeUnsupported


def _rope_frequencies(config: PretrainedConfig, head_size: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` as transformers computes them for this config.

    Every rope type but "default" comes from transformers' own initialisers
    (``ROPE_INIT_FUNCTIONS``), so linear, llama3, yarn, dynamic, ... never
    diverge from the reference implementation.
    """
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise NativeUnsupported("per-layer-type rope_parameters")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        base = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        exponents = torch.arange(0, head_size, 2, dtype=torch.float32) / head_size
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NativeUnsupported(
            f"rope_type {rope_type!r} is not in transformers' ROPE_INIT_FUNCTIONS"
        )
    # transformers recomputes these frequencies inside the forward from the batch's longest
    # sequence; "dynamic" only past max_position_embeddings, where the table ends, so below
    # it the table is exact.
    if rope_type == "longrope" or (rope_type != "dynamic" and "dynamic" in rope_type):
        raise NativeUnsupported(
            f"rope_type {rope_type!r} recomputes its frequencies from each batch's longest "
            "sequence, which a fixed table cannot follow"
        )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    if inv_freq.numel() != head_size // 2:
        raise NativeUnsupported(
            f"rope_type {rope_type!r} rotates {2 * inv_freq.numel()} of {head_size} head dims "
            "(partial_rotary_factor); the native rotary rotates the whole head"
        )
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding from a precomputed cos/sin table indexed by position.

    One table serves every layer (a 128k-position table per layer would cost
    gigabytes). Its rows are transformers' ``cos(position * inv_freq) *
    attention_scaling`` for positions below ``max_position_embeddings``.
    """

    def __init__(self, config: PretrainedConfig, head_size: int):
        super().__init__()
        inv_freq, attention_scaling = _rope_frequencies(config, head_size)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(positions.device))
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x``: [tokens, heads, head_size]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
