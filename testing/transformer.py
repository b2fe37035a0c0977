"""A tiny real transformer for tests and benchmarks: RMSNorm, rotary, GQA, SwiGLU.

Attention goes through the package's splitting op with a plain causal
implementation over the step's tokens (no KV cache), so compiled and eager
outputs can be compared at any token count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import compile_runtime as cr


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, head_size: int, base: float = 10000.0):
    """Neox-style rotary embedding on [tokens, heads, head_size]."""
    half = head_size // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float32, device=x.device) / half))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, prefix: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.layer_name = prefix

    def forward_impl(self, query, key, value, output) -> None:
        n = query.shape[0]
        q = query.view(n, self.num_heads, self.head_size).transpose(0, 1)
        k = key.view(n, self.num_kv_heads, self.head_size).transpose(0, 1)
        v = value.view(n, self.num_kv_heads, self.head_size).transpose(0, 1)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        output.copy_(out.transpose(0, 1).reshape(n, -1))

    def forward(self, q, k, v):
        out = torch.empty_like(q)
        torch.ops.compile_runtime.attention(q, k, v, out, self.layer_name)
        return out


class Block(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, intermediate: int, i: int):
        super().__init__()
        self.head_size = hidden // num_heads
        self.q_size, self.kv_size = num_heads * self.head_size, num_kv_heads * self.head_size
        self.input_norm = RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.attn = CausalSelfAttention(num_heads, num_kv_heads, self.head_size, f"blocks.{i}.attn")
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.post_norm = RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.input_norm(x)).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = rotate(q.view(n, -1, self.head_size), positions, self.head_size).reshape(n, -1)
        k = rotate(k.view(n, -1, self.head_size), positions, self.head_size).reshape(n, -1)
        x = x + self.o_proj(self.attn(q, k, v))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


@cr.compile
class TinyTransformer(nn.Module):
    def __init__(
        self, num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, intermediate=128, vocab=128
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            Block(hidden, num_heads, num_kv_heads, intermediate, i) for i in range(num_layers)
        )
        self.norm = RMSNorm(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, positions)
        return self.norm(x)


def build_transformer(config: cr.CompilationConfig, seed: int = 0, **kwargs) -> TinyTransformer:
    torch.manual_seed(seed)
    with cr.set_compilation_config(config):
        return TinyTransformer(**kwargs).eval()
