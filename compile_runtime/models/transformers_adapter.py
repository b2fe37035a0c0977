"""Run any transformers causal LM through the runtime.

transformers lets a model's attention be swapped by name (its attention
function registry). We register ``compile_runtime``: each attention module of
the Hugging Face model gets one of our ``Attention`` layers, and the function
hands it the flattened tokens. So an architecture we never wrote natively
still gets one trace, the split at attention, piecewise compilation, the
paged KV cache and graphs.

The batch is the runtime's flattened token stream: the Hugging Face model
sees it as a single sequence of ``[1, num_tokens]``; our attention op, not a
mask, keeps requests apart (the mask function returns None).
"""

from __future__ import annotations

import torch
from torch import nn

import compile_runtime as cr
from compile_runtime.attention.layer import Attention

IMPLEMENTATION = "compile_runtime"
_registered = False


def _attention(
    module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """transformers' attention-function signature; query [1, heads, tokens, head_dim]."""
    _, heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    out = module.runtime_attn(
        query.transpose(1, 2).reshape(tokens, heads * head_dim),
        key.transpose(1, 2).reshape(tokens, kv_heads * head_dim),
        value.transpose(1, 2).reshape(tokens, kv_heads * head_dim),
    )
    return out.view(1, tokens, heads, head_dim), None


def _no_mask(*args, **kwargs):
    return None


def register_attention_implementation() -> None:
    """Make ``attn_implementation="compile_runtime"`` known to transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
    _registered = True


@cr.compile
class TransformersBody(nn.Module):
    """The compiled part: the Hugging Face decoder (embeddings to final norm)."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]


class TransformersCausalLM(nn.Module):
    def __init__(self, model_dir: str, hf_config, dtype: torch.dtype):
        super().__init__()
        from transformers import AutoModelForCausalLM

        register_attention_implementation()
        hf = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=IMPLEMENTATION
        )
        self.config = hf.config
        decoder = hf.get_decoder()
        self.lm_head = hf.get_output_embeddings()
        layers = [m for m in decoder.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
        if not layers:
            raise NotImplementedError(
                f"{type(hf).__name__}: found no attention modules (with layer_idx and scaling) "
                "to route through the runtime"
            )
        for module in layers:
            heads = self.config.num_attention_heads
            head_dim = getattr(module, "head_dim", None) or self.config.hidden_size // heads
            module.runtime_attn = Attention(
                heads,
                head_dim,
                scale=module.scaling,
                num_kv_heads=getattr(self.config, "num_key_value_heads", None) or heads,
                prefix=f"hf.layers.{module.layer_idx}.attn",
                sliding_window=getattr(module, "sliding_window", None),
            )
        self.model = TransformersBody(decoder)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
