"""How a model's dimensions divide over ranks, and the start-up check that they do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TensorParallelConfigError(ValueError):
    """The model's shape does not split over the requested number of ranks."""


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise TensorParallelConfigError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}; "
            f"pick a tensor_parallel_size that divides {numerator}"
        )
    return numerator // denominator


@dataclass(frozen=True)
class HeadLayout:
    """Which attention heads one rank holds."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    q_head_start: int  # first query head of this rank in the checkpoint
    kv_head_start: int  # first KV head of this rank in the checkpoint
    kv_replicas: int  # ranks holding a copy of each KV head


def head_layout(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadLayout:
    """Query heads split evenly; KV heads split too, or replicated when fewer than ranks.

    With fewer KV heads than ranks each KV head lives on ``world_size //
    num_kv_heads`` consecutive ranks, which are exactly the ranks holding the
    query heads of its group.
    """
    local_heads = divide(num_heads, world_size, "num_attention_heads")
    if num_kv_heads >= world_size:
        local_kv = divide(num_kv_heads, world_size, "num_key_value_heads")
        replicas = 1
    else:
        if world_size % num_kv_heads:
            raise TensorParallelConfigError(
                f"num_key_value_heads={num_kv_heads} is fewer than tensor_parallel_size="
                f"{world_size} and does not divide it, so KV heads cannot be replicated evenly"
            )
        local_kv, replicas = 1, world_size // num_kv_heads
    return HeadLayout(
        num_heads=local_heads,
        num_kv_heads=local_kv,
        q_head_start=rank * local_heads,
        kv_head_start=(rank // replicas) * local_kv,
        kv_replicas=replicas,
    )


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(start, end, rows per rank): rank's slice of a vocabulary padded to a multiple of ranks."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size), per_rank


def check_tensor_parallel(hf_config: Any, world_size: int) -> None:
    """Reject, before any process starts, a model that does not split over ``world_size``."""
    if world_size < 1:
        raise TensorParallelConfigError(f"tensor_parallel_size={world_size} must be at least 1")
    if world_size == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_layout(heads, kv_heads, 0, world_size)
    divide(hf_config.intermediate_size, world_size, "intermediate_size")
