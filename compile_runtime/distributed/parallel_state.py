"""Who this process is: its tensor-parallel group and its pipeline stage.

The job's ``world_size`` ranks form ``pipeline_parallel_size`` stages of
``world_size / pipeline_parallel_size`` consecutive ranks; the ranks of one
stage are one tensor-parallel group (each holds a slice of the stage's
layers), and rank ``r`` hands its hidden states on to rank ``r + tp_size``.
Model code asks ``get_tp_rank()`` / ``get_tp_world_size()`` / ``get_pp_rank()``
at construction; without ``init_distributed`` a process is rank 0 of 1, stage
0 of 1, and every parallel layer behaves like its plain counterpart.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compile_runtime.platforms.select import platform_for

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ParallelState:
    rank: int  # in the whole job
    world_size: int
    backend: str  # "gloo" or "nccl"
    tp_group: dist.ProcessGroup  # this stage's ranks
    group_name: str  # the tensor-parallel group's name, as functional collectives take it
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None  # layers per stage; None: even split

    @property
    def tp_size(self) -> int:
        return self.world_size // self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size


_state: ParallelState | None = None


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (on ``host``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend(device: torch.device | str) -> str:
    return platform_for(device).distributed_backend


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    pipeline_parallel_size: int = 1,
    pipeline_layer_partition: tuple[int, ...] | None = None,
) -> ParallelState:
    """Join the job's process group as ``rank`` of ``world_size``, then the tensor-parallel
    group of its pipeline stage (every rank creates every stage's group, as torch requires)."""
    global _state
    if _state is not None:
        raise RuntimeError(
            f"init_distributed() called twice in one process (already rank {_state.rank} of "
            f"{_state.world_size}); call destroy_distributed() first"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    if world_size % pipeline_parallel_size:
        raise ValueError(
            f"world_size={world_size} is not a whole number of pipeline_parallel_size="
            f"{pipeline_parallel_size} stages"
        )
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    tp_group = dist.group.WORLD
    if pipeline_parallel_size > 1:
        tp_size = world_size // pipeline_parallel_size
        for stage in range(pipeline_parallel_size):
            ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                tp_group = group
    _state = ParallelState(
        rank,
        world_size,
        backend,
        tp_group,
        tp_group.group_name,
        pipeline_parallel_size,
        pipeline_layer_partition,
    )
    logger.info(
        "rank %d of %d (stage %d of %d) joined the %s group (%s)",
        rank,
        world_size,
        _state.pp_rank,
        pipeline_parallel_size,
        backend,
        init_method,
    )
    return _state


def destroy_distributed() -> None:
    global _state
    _state = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_parallel_state() -> ParallelState | None:
    return _state


def get_tp_rank() -> int:
    return _state.tp_rank if _state is not None else 0


def get_tp_world_size() -> int:
    return _state.tp_size if _state is not None else 1


def get_pp_rank() -> int:
    """This process's pipeline stage (0 outside a pipeline)."""
    return _state.pp_rank if _state is not None else 0


def get_pp_world_size() -> int:
    return _state.pp_size if _state is not None else 1


def pipeline_stage_name() -> str:
    """``"<stage> of <stages>"``: the compile cache key's part for the stage."""
    return f"{get_pp_rank()} of {get_pp_world_size()}"


def get_tp_group() -> dist.ProcessGroup:
    if _state is None:
        raise RuntimeError("no tensor-parallel group: call init_distributed() first")
    return _state.tp_group


def sampling_rank() -> int:
    """The rank that samples: the first rank of the last stage (it holds the logits)."""
    if _state is None:
        return 0
    return (_state.pp_size - 1) * _state.tp_size


def get_tp_group_name() -> str:
    if _state is None:
        raise RuntimeError("no tensor-parallel group: call init_distributed() first")
    return _state.group_name


def rank() -> int:
    """This process's rank in the default group (0 outside torch.distributed)."""
    distributed = dist.is_available() and dist.is_initialized()
    return dist.get_rank() if distributed else 0


def world_size() -> int:
    """Processes in the default group (1 outside torch.distributed)."""
    distributed = dist.is_available() and dist.is_initialized()
    return dist.get_world_size() if distributed else 1
