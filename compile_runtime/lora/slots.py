"""The tensors adapters are loaded into: per linear layer, ``max_loras`` slots of A and B.

A layer's slots hold A ``[slots, parts, max_rank, in]`` and B^T ``[slots, max_rank, out]``
(zero past an adapter's rank), the rank of each slot's adapter per part (0: the adapter
leaves that part alone) and, per output column, the part it belongs to: a fused layer
(q/k/v, gate/up) has one part per projection it fuses. Loading an adapter writes into the
same tensors in place, so the traced graph and every captured graph read it without a
new trace or capture. Under tensor parallelism a slot holds this rank's share, cut as the
layer's weight is (B's rows for a column-parallel layer, A's columns for a row-parallel
one, whose partial sums the all-reduce then adds up).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from compile_runtime.cpu.lora import lora_add_
from compile_runtime.lora.adapter import LoRAAdapter


class Part(NamedTuple):
    projection: str  # the adapter's module name for it: q_proj, gate_proj, ...
    shard: str | int | None  # the layer weight's shard id of it (tp_shard)
    start: int  # its first output column in the layer
    size: int  # its output columns on this rank


class LoRASlots(nn.Module):
    """One linear layer's adapter slots; ``forward(x, y)`` adds each token's adapter to y."""

    def __init__(
        self,
        layer: nn.Module,
        parts: list[Part],
        token_slots: torch.Tensor,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
    ):
        super().__init__()
        # The layer's own sizes and checkpoint cut (its weight may be quantized blocks).
        if hasattr(layer, "input_size_per_rank"):  # row-parallel
            out, in_features = layer.output_size, layer.input_size_per_rank
            self.tp_shard = layer._weight_shard
        else:
            out, in_features = sum(layer.local_sizes), layer.input_size
            self.tp_shard = layer._shard
        self.parts = parts
        device = token_slots.device
        self.register_buffer("token_slots", token_slots, persistent=False)
        self.register_buffer(
            "a", torch.zeros(max_loras, len(parts), max_rank, in_features, dtype=dtype, device=device),
            persistent=False,
        )  # fmt: skip
        self.register_buffer(
            "b", torch.zeros(max_loras, max_rank, out, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "ranks", torch.zeros(max_loras, len(parts), dtype=torch.int32, device=device),
            persistent=False,
        )  # fmt: skip
        sub_of = torch.empty(out, dtype=torch.int32)
        for j, part in enumerate(parts):
            sub_of[part.start : part.start + part.size] = j
        self.register_buffer("sub_of", sub_of.to(device), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        lora_add_(y, x, self.token_slots[: x.shape[0]], self.a, self.b, self.ranks, self.sub_of)

    def _share(
        self, part: Part, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a full A and B (the layer weight's ``tp_shard`` cut)."""
        cut = self.tp_shard(part.shard)
        if cut is None:
            return a, b
        dim, start, length = cut
        if dim == 0:  # column-parallel: this rank's output rows
            return a, b[start : start + length]
        return a[:, start : start + length], b  # row-parallel: this rank's input columns

    @torch.no_grad()
    def load(self, slot: int, adapter: LoRAAdapter, layer_path: str) -> None:
        """Put ``adapter``'s weights for this layer (``layer_path``: its module path, the
        projection's parent, e.g. ``model.layers.0.self_attn``) into ``slot``."""
        self.clear(slot)
        for j, part in enumerate(self.parts):
            pair = adapter.weights.get(f"{layer_path}.{part.projection}")
            if pair is None:
                continue
            a, b = self._share(part, *pair)
            r = a.shape[0]
            self.a[slot, j, :r].copy_(a)
            self.b[slot, :r, part.start : part.start + part.size].copy_(b.T)
            self.ranks[slot, j] = r

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.ranks[slot].zero_()
        self.a[slot].zero_()
        self.b[slot].zero_()
