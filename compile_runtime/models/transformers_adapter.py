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

Whatever else transformers passes to attention is honoured (``softcap``,
``sliding_window``, ``scaling``: checked against the layer) or refused with a
``NotImplementedError`` naming it (``s_aux`` sinks, masks of the model's own,
anything unknown), never dropped. One eager forward at load runs those checks
outside Dynamo and compares our logits with the Hugging Face forward's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import compile_runtime as cr
from compile_runtime.attention.dense import soft_cap
from compile_runtime.attention.layer import Attention

IMPLEMENTATION = "compile_runtime"
_registered = False


# Keyword arguments that never change the attention math: positions (rotary embeddings
# were applied before the call; our op reads positions from the step's metadata) and
# flags about what the model returns. Plus the ones ``_check_call`` compares to the layer.
_CHECKED_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "num_items_in_batch",
        "softcap",
        "sliding_window",
        "is_causal",
    }
)


def _attention(
    module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """transformers' attention-function signature; query [1, heads, tokens, head_dim].

    Every argument that changes the math is checked against what the layer
    computes (``_check_call``): a model whose attention we do not implement
    fails instead of generating different tokens.
    """
    _, heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    _check_call(module, head_dim, attention_mask, scaling, dropout, kwargs)
    out = module.runtime_attn(
        query.transpose(1, 2).reshape(tokens, heads * head_dim),
        key.transpose(1, 2).reshape(tokens, kv_heads * head_dim),
        value.transpose(1, 2).reshape(tokens, kv_heads * head_dim),
    )
    return out.view(1, tokens, heads, head_dim), None


def _check_call(
    module: nn.Module, head_dim: int, attention_mask, scaling, dropout, kwargs: dict
) -> None:
    """Raise ``NotImplementedError`` for any argument the layer would not honour.

    Runs while Dynamo traces (the arguments are Python constants there), so it
    costs nothing per step once compiled.
    """
    layer: Attention = module.runtime_attn
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    where = f"{model_type} (layer {layer.layer_name!r})"
    rebuild = (
        "; the adapter built the layer from the wrong attribute for this model. Run it with "
        "transformers itself, or fix TransformersCausalLM's layer construction."
    )

    def refuse(message: str) -> NotImplementedError:
        return NotImplementedError(f"{where}: {message}")

    # transformers caps only when it passes softcap: absent means no cap.
    softcap = kwargs.get("softcap")
    if softcap != layer.logits_soft_cap:
        raise refuse(
            f"transformers calls attention with softcap={softcap!r}, but the runtime's layer "
            f"was built with logits_soft_cap={layer.logits_soft_cap!r}" + rebuild
        )
    window = kwargs.get("sliding_window", layer.sliding_window)
    if window != layer.sliding_window:
        raise refuse(
            f"transformers calls attention with sliding_window={window!r}, but the runtime's "
            f"layer was built with sliding_window={layer.sliding_window!r}" + rebuild
        )
    scale = scaling if scaling is not None else head_dim**-0.5
    if not math.isclose(scale, layer.scale, rel_tol=1e-6):
        raise refuse(
            f"transformers calls attention with scaling={scale!r}, but the runtime's layer was "
            f"built with scale={layer.scale!r}" + rebuild
        )
    if dropout:
        raise refuse(
            f"attention dropout={dropout!r} is training-only and not implemented; put the "
            "model in eval mode (model.eval())."
        )
    if kwargs.get("is_causal") is False:
        raise refuse(
            "transformers asks for bidirectional attention (is_causal=False); the runtime's "
            "attention is causal only. Run this model with transformers."
        )
    if attention_mask is not None:
        raise refuse(
            "the model passes its own attention mask (not built through transformers' mask "
            "interface, whose masks the runtime replaces with per-request causal attention); "
            "it would be ignored. Use a model with a native implementation or run this one "
            "with transformers."
        )
    for name, value in kwargs.items():
        if name not in _CHECKED_KWARGS and value is not None:
            raise refuse(
                f"transformers passes the attention argument {name!r} "
                f"({type(value).__name__}), which the runtime's attention does not implement; "
                "ignoring it would silently change the outputs. Use a model with a native "
                "implementation or run this one with transformers (another attn_implementation)."
            )


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
            model_dir, config=hf_config, dtype=dtype, attn_implementation=IMPLEMENTATION
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
                sliding_window=_sliding_window_of(module, self.config),
                logits_soft_cap=_soft_cap_of(module, self.config),
            )
        self.model = TransformersBody(decoder)
        self.final_logit_soft_cap = getattr(self.config, "final_logit_softcapping", None)
        self._self_check(hf, decoder)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head, then the final soft cap where the model has one (Gemma 2's
        ``final_logit_softcapping``, applied by the Hugging Face model's forward, not its head)."""
        logits = self.lm_head(hidden_states)
        if self.final_logit_soft_cap is not None:
            logits = soft_cap(logits, self.final_logit_soft_cap)
        return logits

    @torch.no_grad()
    def _self_check(self, hf: nn.Module, decoder: nn.Module) -> None:
        """One eager forward of a few tokens at load (attention dense, no cache), for two checks.

        Every attention call's arguments go through ``_check_call`` outside Dynamo, so an
        unsupported one raises its own error here instead of inside a trace (where Dynamo
        reports it as a graph break). And our logits are ``compute_logits(decoder(...))``,
        but a Hugging Face forward may transform its head's output (Gemma's final soft cap,
        Cohere's ``logit_scale``, Granite's ``logits_scaling``, ...): one we do not reproduce
        fails here, not as silently different samples.
        """
        device = self.lm_head.weight.device
        ids = torch.arange(1, 5, device=device)[None] % self.config.vocab_size
        theirs = hf(input_ids=ids, use_cache=False).logits[0].float()
        ours = self.compute_logits(decoder(input_ids=ids, use_cache=False).last_hidden_state[0])
        if not torch.allclose(ours.float(), theirs, rtol=1e-3, atol=1e-3):
            raise NotImplementedError(
                f"{self.config.model_type}: the Hugging Face model's forward transforms the LM "
                "head's logits in a way the transformers adapter does not reproduce (max "
                f"difference {(ours.float() - theirs).abs().max().item():.3g}); sampling would "
                "silently differ. Run this model with transformers, or teach "
                "TransformersCausalLM.compute_logits the transform."
            )


def _sliding_window_of(module: nn.Module, config) -> int | None:
    """The module's window (per layer: Gemma 2, Qwen2), else the config's (Mistral's modules
    have none and pass ``config.sliding_window`` to every call)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(config, "sliding_window", None)


def _soft_cap_of(module: nn.Module, config) -> float | None:
    """The attention logit soft cap (Gemma 2): the module's attribute, else the config's."""
    cap = getattr(module, "attn_logit_softcapping", None)
    return cap if cap is not None else getattr(config, "attn_logit_softcapping", None)
