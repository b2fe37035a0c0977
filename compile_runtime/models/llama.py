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
from torch import nn
from transformers import PretrainedConfig

import compile_runtime as cr
from compile_runtime.attention.layer import Attention
from compile_runtime.cpu.quant_embedding import quant_embedding
from compile_runtime.cpu.quant_formats import QuantFormat
from compile_runtime.distributed import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from compile_runtime.distributed.communication import tensor_parallel_all_reduce
from compile_runtime.distributed.pipeline import PipelineStage, pipeline_stage
from compile_runtime.models.loader import (
    FusedShards,
    NativeUnsupported,
    StackedParam,
    load_weights,
    quantization_plan,
    quantize_parameters,
)
from compile_runtime.models.rotary import RotaryEmbedding


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


def head_size_of(config: PretrainedConfig) -> int:
    """``head_dim`` where the config sets it (Qwen3), else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window, as transformers applies it.

    Mistral windows every layer when ``sliding_window`` is set; Qwen2/3 only
    the layers ``layer_types`` calls "sliding_attention" (and only with
    ``use_sliding_window``).
    """
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", window is not None):
        window = None
    layer_types = getattr(config, "layer_types", None)
    if window is None or layer_types is None:
        return [window] * config.num_hidden_layers
    kinds = {"full_attention": None, "sliding_attention": window}
    for kind in layer_types:
        if kind not in kinds:
            raise NativeUnsupported(f"layer type {kind!r} in config.layer_types")
    return [kinds[kind] for kind in layer_types]


def activation(config: PretrainedConfig) -> nn.Module:
    """The MLP gate activation: transformers' own ``ACT2FN[config.hidden_act]``."""
    from transformers.activations import ACT2FN

    name = getattr(config, "hidden_act", "silu")
    if name not in ACT2FN:
        raise ValueError(
            f"hidden_act {name!r} is not an activation transformers knows (ACT2FN: "
            f"{sorted(ACT2FN)}); fix config.json"
        )
    act = ACT2FN[name]
    if list(act.parameters()) or list(act.buffers()):
        raise NativeUnsupported(f"hidden_act {name!r} has learned parameters")
    return act


class SelfAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        flags: ArchFlags,
        prefix: str,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_size = head_size_of(config)
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
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads,
            self.head_size,
            scale=self.head_size**-0.5,
            num_kv_heads=self.num_kv_heads,
            prefix=f"{prefix}.attn",
            sliding_window=sliding_window,
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
    def __init__(self, config: PretrainedConfig, act_fn: nn.Module):
        super().__init__()
        self.act_fn = act_fn
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
        return self.down_proj(self.act_fn(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        flags: ArchFlags,
        prefix: str,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        act_fn: nn.Module,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, flags, f"{prefix}.self_attn", rotary, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, act_fn)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: keeps the layer indices (and so the checkpoint's
    names) of the stages after it."""


@cr.compile
class DecoderModel(nn.Module):
    """The compiled part: embeddings, every layer, the final norm; under pipeline parallelism
    the stage's share (``stage``): the embedding on the first stage, the norm on the last,
    and every stage but the first starts from the previous stage's ``hidden_states``."""

    def __init__(
        self,
        config: PretrainedConfig,
        flags: ArchFlags,
        rotary: RotaryEmbedding,
        windows: list[int | None],
        act_fn: nn.Module,
        stage: PipelineStage,
    ):
        super().__init__()
        self.stage = stage
        self.embed_tokens = None
        if stage.holds_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, flags, f"model.layers.{i}", rotary, windows[i], act_fn)
            if stage.holds_layer(i)
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = embed(self.embed_tokens, input_ids) if self.stage.is_first else hidden_states
        for layer in self.layers[self.stage.start : self.stage.end]:
            x = layer(positions, x)
        return self.norm(x) if self.stage.is_last else x

    def own_layers(self) -> list[DecoderLayer]:
        return list(self.layers[self.stage.start : self.stage.end])


def embed(embedding: VocabParallelEmbedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The embedding of ``input_ids``; a quantized table dequantizes only the rows looked up
    (in ``embedding.out_dtype``, the model's dtype)."""
    weight = embedding.weight
    if weight.dtype != torch.uint8:
        return embedding(input_ids)
    if embedding.world_size == 1:
        return quant_embedding(input_ids, weight, embedding.out_dtype)
    owned = (input_ids >= embedding.vocab_start) & (input_ids < embedding.vocab_end)
    local_ids = torch.where(owned, input_ids - embedding.vocab_start, 0)
    x = quant_embedding(local_ids, weight, embedding.out_dtype)
    return tensor_parallel_all_reduce(x * owned.unsqueeze(-1).to(x.dtype))


class CausalLM(nn.Module):
    """A Llama-family causal LM: ``forward`` gives hidden states, ``compute_logits`` the logits.

    Raises ``NativeUnsupported`` for a config it cannot run exactly as
    transformers does, before it allocates any layer.
    """

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        model_type = config.model_type
        if model_type not in ARCHITECTURES:
            raise NativeUnsupported(
                f"no native implementation for model_type {model_type!r} (have: "
                f"{sorted(ARCHITECTURES)})"
            )
        rotary = RotaryEmbedding(config, head_size_of(config))
        windows = sliding_windows(config)
        act_fn = activation(config)
        self.config = config
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.stage = pipeline_stage(config.num_hidden_layers, tied=self.tied)
        flags = ARCHITECTURES[model_type]
        self.model = DecoderModel(config, flags, rotary, windows, act_fn, self.stage)
        self.lm_head = None
        if self.stage.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tied:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits of ``hidden_states``; under tensor parallelism on the first rank only, under
        pipeline parallelism on the last stage only (None elsewhere)."""
        if self.lm_head is None:
            return None
        return self.lm_head.compute_logits(hidden_states)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.own_layers()]

    def _layouts(self) -> tuple[list[StackedParam], dict[str, FusedShards]]:
        attn = self.model.own_layers()[0].self_attn
        mlp = self.model.own_layers()[0].mlp
        stacked = [
            StackedParam("qkv_proj", "q_proj", "q"),
            StackedParam("qkv_proj", "k_proj", "k"),
            StackedParam("qkv_proj", "v_proj", "v"),
            StackedParam("gate_up_proj", "gate_proj", 0),
            StackedParam("gate_up_proj", "up_proj", 1),
        ]
        fused = {
            "qkv_proj": FusedShards({"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}),
            "gate_up_proj": FusedShards({0: mlp.intermediate, 1: mlp.intermediate}),
        }
        return stacked, fused

    def quantize_weights(self, model_dir: str, quantization: str) -> dict[str, QuantFormat]:
        """Make the linear weights (and a quantized embedding table) ``uint8`` blocks of the
        formats ``quantization_plan`` chooses ("gguf": the file's Q8_0/Q4_0/Q4_1; "int8":
        Q8_0 of a float checkpoint), for ``load_weights`` to fill. Before loading; CPU."""
        stacked, _ = self._layouts()
        quantizable = {
            name
            for name, module in self.named_modules()
            if hasattr(module, "use_packed_weight") or module is self.model.embed_tokens
        }
        candidates = {f"{name}.weight" for name in quantizable}
        if self.tied:
            candidates.discard("lm_head.weight")
        plan = quantization_plan(model_dir, quantization, candidates, stacked, self.tied)
        self.apply_quantization(plan)
        return plan

    def apply_quantization(self, plan: dict[str, QuantFormat]) -> None:
        """Make the planned weights empty ``uint8`` blocks of their formats (the embedding's
        output dtype kept, a tied LM head on the same blocks); before loading."""
        dtype = next(self.parameters()).dtype
        quantize_parameters(self, plan)
        if self.model.embed_tokens is not None:
            self.model.embed_tokens.out_dtype = dtype
        if self.tied and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.use_packed_weight = self.lm_head.weight.dtype == torch.uint8

    def load_weights(self, model_dir: str) -> None:
        stacked, fused = self._layouts()
        load_weights(
            self,
            model_dir,
            stacked_params=stacked,
            fused_shards=fused,
            ignore=("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tied else ()),
            holds=self.stage.holds_weight,
        )
