"""``Attention``: the layer model code calls; the custom op is its body.

``forward`` only allocates the output and, when traced, calls
``torch.ops.compile_runtime.attention``, so Dynamo sees one opaque node (the
split point) and nothing about caches or metadata. The op calls back into
``forward_impl`` here, which reads the step's metadata from the forward
context and runs the backend chosen at construction.

Without a forward context, or with metadata ``None`` for this layer (a
profiling or dummy run, the first Dynamo trace), the layer computes plain
causal self-attention over the given tokens as one sequence and touches no
cache. With metadata, a cache must have been bound (``bind_kv_cache``).
"""

from __future__ import annotations

import torch
from torch import nn

from compile_runtime.attention.dense import dense_causal_attention
from compile_runtime.attention.selector import get_attn_backend
from compile_runtime.attention.spec import AttentionSpec
from compile_runtime.forward_context import get_forward_context, is_forward_context_available


class Attention(nn.Module):
    """Paged, grouped-query attention over the custom op.

    query [tokens, num_heads * head_size], key/value [tokens, num_kv_heads *
    head_size] -> output [tokens, num_heads * head_size]. The backend is
    picked from the default device and dtype at construction (build the model
    under ``with torch.device(...)`` and ``torch.set_default_dtype``), or by
    name with ``backend=`` / ``use_attn_backend(name)``. ``sliding_window`` and
    ``logits_soft_cap`` (Gemma 2's tanh cap on the scaled logits) go to the
    backend through the layer's ``AttentionSpec``.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        *,
        backend: str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.spec = AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=head_size,
            scale=scale,
            sliding_window=sliding_window,
            dtype=dtype or torch.get_default_dtype(),
            logits_soft_cap=logits_soft_cap,
        )
        self.attn_backend = get_attn_backend(backend, dtype=self.spec.dtype, head_size=head_size)
        self.impl = self.attn_backend.make_impl(self.spec)
        # [2, num_blocks, block_size, num_kv_heads, head_size]; see attention/kv_cache.py.
        self.kv_cache: torch.Tensor | None = None
        # The op finds the layer by this name in its model's table (attention/op.py).
        self.layer_name = prefix or "attn"

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        cap = f", logits_soft_cap={self.logits_soft_cap}" if self.logits_soft_cap else ""
        return (
            f"{self.layer_name!r}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, backend={self.attn_backend.name}{window}{cap}"
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        output = query.new_empty(query.shape[0], self.num_heads * self.head_size)
        if torch.compiler.is_compiling():  # the split point Dynamo sees
            torch.ops.compile_runtime.attention(query, key, value, output, self.layer_name)
        else:  # eager: the op's body, without its dispatch or the lookup
            self.forward_impl(query, key, value, output)
        return output

    def forward_impl(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor
    ) -> None:
        """Called by the custom op with this step's tokens; fills ``output``."""
        n = query.shape[0]
        q = query.view(n, self.num_heads, self.head_size)
        k = key.view(n, self.num_kv_heads, self.head_size)
        v = value.view(n, self.num_kv_heads, self.head_size)
        out = output.view(n, self.num_heads, self.head_size)
        metadata = None
        if is_forward_context_available():
            metadata = get_forward_context().metadata_for(self.layer_name)
        if metadata is None:
            out.copy_(
                dense_causal_attention(
                    q, k, v, self.scale, self.sliding_window, self.logits_soft_cap
                )
            )
            return
        if self.kv_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_name!r} got step metadata but has no KV cache; "
                "allocate and bind one first (compile_runtime.attention.allocate_kv_cache, "
                "bind_kv_cache)"
            )
        self.impl.forward(q, k, v, self.kv_cache, metadata, out)


def attention_layers(model: nn.Module) -> list[Attention]:
    """Every ``Attention`` layer of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, Attention)]
