"""Collectives the models and the runner use.

``tensor_parallel_all_reduce`` runs inside the compiled forward: it calls the
functional collective ops (``_c10d_functional.all_reduce`` + ``wait_tensor``),
which Dynamo traces as ordinary graph nodes and Inductor lowers, so one trace
still covers the whole model and the all-reduce is never a split point.
The others run outside the graph: the logits gather to the stage's first rank,
the sampled tokens' broadcast from rank 0 (tensor parallelism alone), and the
hand-over of hidden states from one pipeline stage to the next (point to point,
rank ``r`` to rank ``r + tp_size``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compile_runtime.distributed.parallel_state import (
    get_parallel_state,
    get_tp_group,
    get_tp_group_name,
    get_tp_rank,
    get_tp_world_size,
)
from compile_runtime.torch_internals import functional_all_reduce


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (identity on one rank); traceable."""
    if get_tp_world_size() == 1:
        return x
    return functional_all_reduce(x, "sum", get_tp_group_name())


def gather_to_first_rank(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate the tensor-parallel ranks' ``x`` along ``dim`` on the group's first rank;
    the others get None."""
    world = get_tp_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    group = get_tp_group()
    parts = [torch.empty_like(x) for _ in range(world)] if get_tp_rank() == 0 else None
    dist.gather(x, parts, dst=dist.get_global_rank(group, 0), group=group)
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_from_first_rank(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every tensor-parallel rank (in place; every rank passes a tensor of
    the same shape; one stage only)."""
    if get_tp_world_size() > 1:
        dist.broadcast(x, src=0)
    return x


def send_to_next_stage(x: torch.Tensor) -> None:
    """Hand ``x`` to this rank's peer in the next pipeline stage (same tensor-parallel rank)."""
    state = get_parallel_state()
    dist.send(x.contiguous(), dst=state.rank + state.tp_size)


def receive_from_previous_stage(out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (in place) with what the previous stage's peer sent."""
    state = get_parallel_state()
    dist.recv(out, src=state.rank - state.tp_size)
    return out
