"""Who this process is in the tensor-parallel group.

One group: every rank of the job holds one slice of every layer (no
pipeline stages). Model code asks ``get_tp_rank()`` / ``get_tp_world_size()``
at construction; without ``init_distributed`` a process is rank 0 of 1 and
every parallel layer behaves like its plain counterpart.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    group_name: str  # the process group's name, as functional collectives take it


_state: ParallelState | None = None


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (on ``host``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> ParallelState:
    """Join the job's process group as ``rank`` of ``world_size``."""
    global _state
    if _state is not None:
        raise RuntimeError(
            f"init_distributed() called twice in one process (already rank {_state.rank} of "
            f"{_state.world_size}); call destroy_distributed() first"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _state = ParallelState(rank, world_size, backend, dist.group.WORLD.group_name)
    logger.info("rank %d of %d joined the %s group (%s)", rank, world_size, backend, init_method)
    return _state


def destroy_distributed() -> None:
    global _state
    _state = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_parallel_state() -> ParallelState | None:
    return _state


def get_tp_rank() -> int:
    return _state.rank if _state is not None else 0


def get_tp_world_size() -> int:
    return _state.world_size if _state is not None else 1


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
