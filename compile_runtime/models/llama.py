"""Native Llama-family decoder: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm).

Written for the runtime: q/k/v and gate/up are fused into one matmul each,
attention goes through the package's splitting op (so the graph splits there
and the KV cache is paged), and the decoder body is ``@compile``-decorated
while the LM head runs outside the graph on the last position of each request.

Tensor parallelism: the projections are the column/row-parallel layers of
``compile_runtime.distributed`` (heads and intermediate columns split over
ranks, one all-reduce after o_proj and after down_proj, inside the traced
graph), the embedding and LM head split the vocabulary. On one rank they are
plain ``F.linear`` / ``F.embedding`` calls, so TP=1 computes what it always did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

import compile_runtime as cr
from compile_runtime.attention import Attention
from compile_runtime.distributed import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from compile_runtime.models.loader import FusedShards, StackedParam, load_weights


@dataclass(frozen=True)
class ArchFlags:
    qkv_bias: bool | None = None  # None: read config.attention_bias
    qk_norm: bool = False


ARCHITECTURES: dict[str, ArchFlags] = {
    "llama": ArchFlags(),
    "mistral": ArchFlags(qkv_bias=False),
    "qwen2": ArchFlags(qkv_bias=True),
    "qwen3": ArchFlags(qk_norm=True),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding from a precomputed cos/sin table indexed by position."""

    def __init__(self, head_size: int, max_positions: int, rope: dict | None, dtype: torch.dtype):
        super().__init__()
        rope = dict(rope or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        base = float(rope.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        positions = torch.arange(max_positions, dtype=torch.float32)
        if rope_type == "linear":
            positions = positions / float(rope["factor"])
        elif rope_type != "default":
            raise NotImplementedError(
                f"rope_type {rope_type!r} is not supported by the native models yet (default, "
                "linear); run this model through the transformers adapter instead"
            )
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x``: [tokens, heads, head_size]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: ArchFlags, prefix: str, dtype: torch.dtype):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        bias = (
            flags.qkv_bias
            if flags.qkv_bias is not None
            else getattr(config, "attention_bias", False)
        )
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_size, total_heads, total_kv_heads, bias=bias
        )
        # This rank's heads (all of them on one rank).
        self.num_heads = self.qkv_proj.layout.num_heads
        self.num_kv_heads = self.qkv_proj.layout.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        o_bias = getattr(config, "attention_bias", False) and flags.qkv_bias is None
        self.o_proj = RowParallelLinear(
            total_heads * self.head_size, config.hidden_size, bias=o_bias, name="o_proj"
        )
        self.qk_norm = flags.qk_norm
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            self.head_size,
            config.max_position_embeddings,
            getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None),
            dtype=torch.float32,
        )
        window = getattr(config, "sliding_window", None)
        if not getattr(config, "use_sliding_window", window is not None):
            window = None
        self.attn = Attention(
            self.num_heads,
            self.head_size,
            scale=self.head_size**-0.5,
            num_kv_heads=self.num_kv_heads,
            prefix=f"{prefix}.attn",
            sliding_window=window,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_size)
        k = k.view(n, self.num_kv_heads, self.head_size)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotary(positions, q).to(x.dtype).reshape(n, self.q_size)
        k = self.rotary(positions, k).to(x.dtype).reshape(n, self.kv_size)
        return self.o_proj(self.attn(q, k, v))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(
                f"hidden_act {config.hidden_act!r}: only silu (SwiGLU) is supported"
            )
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, name="gate_up_proj"
        )
        self.intermediate = self.gate_up_proj.local_sizes[0]  # this rank's columns
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=bias, name="down_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.intermediate, self.intermediate], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, flags: ArchFlags, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, flags, f"{prefix}.self_attn", dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


@cr.compile
class DecoderModel(nn.Module):
    """The compiled part: embeddings, every layer, the final norm."""

    def __init__(self, config: PretrainedConfig, flags: ArchFlags, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, flags, f"model.layers.{i}", dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class CausalLM(nn.Module):
    """A Llama-family causal LM: ``forward`` gives hidden states, ``compute_logits`` the logits."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        model_type = config.model_type
        if model_type not in ARCHITECTURES:
            raise NotImplementedError(
                f"no native implementation for model_type {model_type!r} (have: "
                f"{sorted(ARCHITECTURES)}); use the transformers adapter for other architectures"
            )
        self.config = config
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.model = DecoderModel(config, ARCHITECTURES[model_type], dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits of ``hidden_states``; under tensor parallelism on rank 0 only (None elsewhere)."""
        return self.lm_head.compute_logits(hidden_states)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, model_dir: str) -> None:
        attn = self.model.layers[0].self_attn
        mlp = self.model.layers[0].mlp
        load_weights(
            self,
            model_dir,
            stacked_params=[
                StackedParam("qkv_proj", "q_proj", "q"),
                StackedParam("qkv_proj", "k_proj", "k"),
                StackedParam("qkv_proj", "v_proj", "v"),
                StackedParam("gate_up_proj", "gate_proj", 0),
                StackedParam("gate_up_proj", "up_proj", 1),
            ],
            fused_shards={
                "qkv_proj": FusedShards({"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}),
                "gate_up_proj": FusedShards({0: mlp.intermediate, 1: mlp.intermediate}),
            },
            ignore=("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tied else ()),
        )
