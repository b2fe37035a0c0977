"""Collectives the models and the runner use.

``tensor_parallel_all_reduce`` runs inside the compiled forward: it calls the
functional collective ops (``_c10d_functional.all_reduce`` + ``wait_tensor``),
which Dynamo traces as ordinary graph nodes and Inductor lowers, so one trace
still covers the whole model and the all-reduce is never a split point.
The others run outside the graph (logits gather, sampled-token broadcast).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compile_runtime.distributed.parallel_state import (
    get_tp_group_name,
    get_tp_rank,
    get_tp_world_size,
)


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (identity on one rank); traceable."""
    if get_tp_world_size() == 1:
        return x
    reduced = torch.ops._c10d_functional.all_reduce(x, "sum", get_tp_group_name())
    return torch.ops._c10d_functional.wait_tensor(reduced)


def gather_to_first_rank(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on rank 0; other ranks get None."""
    world = get_tp_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)] if get_tp_rank() == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_from_first_rank(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank (in place; every rank passes a tensor of the same shape)."""
    if get_tp_world_size() > 1:
        dist.broadcast(x, src=0)
    return x
