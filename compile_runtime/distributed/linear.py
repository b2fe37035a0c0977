"""Tensor-parallel linear layers.

A column-parallel layer holds a slice of the output features (no
communication: each rank computes its own heads / intermediate columns); a
row-parallel layer holds the matching slice of the input features and sums
the partial products with one all-reduce. On one rank both are exactly
``nn.Linear`` (same parameters, same ``F.linear`` call, same bits), unless the
runner packed their weights for oneDNN on a CPU (``compile_runtime.cpu.linear``).

Every parameter carries ``tp_shard(shard_id) -> (dim, start, length) | None``:
the part of the checkpoint tensor this rank reads (None: all of it). The
weight loader uses it to read only that slice from the safetensors file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from compile_runtime.cpu.linear import linear
from compile_runtime.distributed.communication import tensor_parallel_all_reduce
from compile_runtime.distributed.parallel_state import get_tp_rank, get_tp_world_size
from compile_runtime.distributed.sharding import HeadLayout, divide, head_layout

ShardFn = Callable[[object], "tuple[int, int, int] | None"]


def _param(shape: Sequence[int], shard: ShardFn) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape))
    p.tp_shard = shard  # type: ignore[attr-defined]
    return p


def _init_like_linear(weight: nn.Parameter, bias: nn.Parameter | None, fan_in: int) -> None:
    """``nn.Linear``'s initialisation (a model built without a checkpoint is still sane)."""
    with torch.no_grad():
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if bias is not None:
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(bias, -bound, bound)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split over ranks; output stays split."""

    use_packed_weight = False  # set by compile_runtime.cpu.linear.pack_linear_weights

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, name: str):
        super().__init__()
        self.rank, self.world_size = get_tp_rank(), get_tp_world_size()
        self.input_size = input_size
        # Per checkpoint part (one for a plain layer, several for a fused one): rows on this rank.
        self.local_sizes = [divide(s, self.world_size, f"{name} output size") for s in output_sizes]
        out = sum(self.local_sizes)
        self.weight = _param((out, input_size), self._shard)
        self.bias = _param((out,), self._shard) if bias else None
        _init_like_linear(self.weight, self.bias, input_size)
        self.lora: nn.Module | None = None  # adapter slots (lora/slots.py) when LoRA is on

    def _shard(self, shard_id: object) -> tuple[int, int, int] | None:
        if self.world_size == 1:
            return None
        size = self.local_sizes[0 if shard_id is None else int(shard_id)]  # type: ignore[arg-type]
        return 0, self.rank * size, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.use_packed_weight)
        if self.lora is not None:
            self.lora(x, y)
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out_per_rank={self.local_sizes}, "
            f"bias={self.bias is not None}, tp={self.world_size}"
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers fused in one matmul (gate/up); shard ids 0, 1, ..."""


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads; shard ids ``"q"``, ``"k"``, ``"v"``.

    KV heads split like query heads, or are replicated when there are fewer
    KV heads than ranks (each rank then reads the one KV head its query
    heads attend to).
    """

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool
    ):
        nn.Module.__init__(self)
        self.rank, self.world_size = get_tp_rank(), get_tp_world_size()
        self.input_size = hidden_size
        self.head_size = head_size
        self.layout: HeadLayout = head_layout(num_heads, num_kv_heads, self.rank, self.world_size)
        self.q_size = self.layout.num_heads * head_size
        self.kv_size = self.layout.num_kv_heads * head_size
        self.local_sizes = [self.q_size, self.kv_size, self.kv_size]
        out = self.q_size + 2 * self.kv_size
        self.weight = _param((out, hidden_size), self._shard)
        self.bias = _param((out,), self._shard) if bias else None
        _init_like_linear(self.weight, self.bias, hidden_size)
        self.lora: nn.Module | None = None

    def _shard(self, shard_id: object) -> tuple[int, int, int] | None:
        if self.world_size == 1:
            return None
        if shard_id == "q":
            return 0, self.layout.q_head_start * self.head_size, self.q_size
        return 0, self.layout.kv_head_start * self.head_size, self.kv_size


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split over ranks; one all-reduce sums them.

    The input arrives already split (the output of a column-parallel layer);
    the bias is added once, after the sum.
    """

    use_packed_weight = False  # set by compile_runtime.cpu.linear.pack_linear_weights

    def __init__(self, input_size: int, output_size: int, bias: bool, name: str):
        super().__init__()
        self.rank, self.world_size = get_tp_rank(), get_tp_world_size()
        self.input_size_per_rank = divide(input_size, self.world_size, f"{name} input size")
        self.output_size = output_size
        self.weight = _param((output_size, self.input_size_per_rank), self._weight_shard)
        self.bias = _param((output_size,), lambda _: None) if bias else None
        _init_like_linear(self.weight, self.bias, self.input_size_per_rank)
        self.lora: nn.Module | None = None  # adapter slots (lora/slots.py) when LoRA is on

    def _weight_shard(self, shard_id: object) -> tuple[int, int, int] | None:
        if self.world_size == 1:
            return None
        n = self.input_size_per_rank
        return 1, self.rank * n, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            y = linear(x, self.weight, self.bias, self.use_packed_weight)
            if self.lora is not None:
                self.lora(x, y)
            return y
        y = linear(x, self.weight, None, self.use_packed_weight)
        if self.lora is not None:  # this rank's partial sum, added up by the all-reduce
            self.lora(x, y)
        y = tensor_parallel_all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_per_rank={self.input_size_per_rank}, out={self.output_size}, "
            f"bias={self.bias is not None}, tp={self.world_size}"
        )
