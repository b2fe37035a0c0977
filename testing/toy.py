"""Small models shared by the compiler tests."""

from __future__ import annotations

import torch
from torch import nn

import compile_runtime as cr


class SumAttention(nn.Module):
    """Deterministic stand-in for attention: out = q + k + v, through the splitting op."""

    def __init__(self, prefix: str):
        super().__init__()
        self.layer_name = prefix

    def forward_impl(self, query, key, value, output) -> None:
        output.copy_(query + key + value)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        torch.ops.compile_runtime.attention(q, k, v, out, self.layer_name)
        return out


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, index: int):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn = SumAttention(f"layers.{index}.attn")
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.out(torch.relu(self.attn(q, k, v)))


@cr.compile
class ToyModel(nn.Module):
    def __init__(self, num_layers: int = 3, hidden: int = 16, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyLayer(hidden, i) for i in range(num_layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def build(config: cr.CompilationConfig, seed: int = 0, **kwargs) -> ToyModel:
    torch.manual_seed(seed)
    with cr.set_compilation_config(config):
        return ToyModel(**kwargs).eval()
