"""Executors: how the engine reaches the model runner on every rank.

``base.py`` is the interface; this file is the factory: ``make_executor`` checks the
engine's (frozen, already decided) configuration once, before any worker starts, then starts
the executor the backend names: ``uniproc`` (the runner in this process), ``multiproc`` (one
worker process per rank on this machine) or ``ray_executor`` (workers as Ray actors).
``standby.py`` keeps worker processes spawned and imported ahead, for a quick restart.
"""

from __future__ import annotations

import torch

from compile_runtime.config import ConfigError, EngineConfig
from compile_runtime.distributed.pipeline import PipelineConfigError, stage_layer_counts
from compile_runtime.distributed.sharding import TensorParallelConfigError, check_tensor_parallel
from compile_runtime.executor.base import Executor, ExecutorError, WorkerDiedError, WorkerInfo
from compile_runtime.executor.multiproc import MultiprocExecutor
from compile_runtime.executor.ray_executor import RayExecutor, import_ray
from compile_runtime.executor.standby import StandbyWorkers
from compile_runtime.executor.uniproc import UniProcExecutor
from compile_runtime.models.llama import ARCHITECTURES
from compile_runtime.platforms.select import platform_for

BACKENDS = ("uni", "mp", "ray")


def executor_class(backend: str | None, world_size: int) -> type[Executor]:
    """The executor for ``distributed_executor_backend`` (None: "uni" on one rank, else "mp");
    ``world_size``: the engine's ranks (tensor x pipeline parallel)."""
    if backend is None:
        backend = "uni" if world_size == 1 else "mp"
    if backend not in BACKENDS:
        raise ValueError(f"distributed_executor_backend={backend!r} is not one of {list(BACKENDS)}")
    if backend == "uni":
        if world_size != 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank in this process; "
                f"{world_size} ranks (tensor x pipeline parallel) need 'mp' or 'ray'"
            )
        return UniProcExecutor
    if backend == "mp":
        return MultiprocExecutor
    import_ray()  # fails here, naming what to install, when ray is missing
    return RayExecutor


def check_model(config: EngineConfig) -> None:
    """Reject, before any worker starts, a model this configuration cannot run."""
    config.runner_config.check_model(config.hf_config, config.model_dir)
    check_model_for_parallelism(config)


def check_model_for_parallelism(config: EngineConfig) -> None:
    """Reject a model that cannot run on ``tensor_parallel_size`` ranks per stage in
    ``pipeline_parallel_size`` stages."""
    hf_config = config.hf_config
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp == pp == 1:
        return
    if config.use_transformers or hf_config.model_type not in ARCHITECTURES:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs a native model "
            f"({sorted(ARCHITECTURES)}); {hf_config.model_type!r}"
            f"{' through the transformers adapter' if config.use_transformers else ''} runs on "
            "one rank only"
        )
    check_tensor_parallel(hf_config, tp)
    stage_layer_counts(hf_config.num_hidden_layers, pp, config.pipeline_layer_partition)
    if pp > 1 and config.runner_config.enable_microbatching:
        raise PipelineConfigError(
            "enable_microbatching with pipeline_parallel_size > 1: the stages already overlap "
            "whole steps; turn one of them off"
        )


def make_executor(
    config: EngineConfig,
    backend: str | None = None,
    standby: StandbyWorkers | None = None,
) -> Executor:
    """Check the configuration, then start the executor (and through it every worker).

    Every worker gets ``config`` whole, the model's config in it (``config.hf_config``, read
    once by the engine); ``standby``: processes for the ranks of a ``MultiprocExecutor``
    (other executors ignore it)."""
    cls = executor_class(backend, config.world_size)
    if cls.local_ranks:
        check_device_available(config)
    check_model(config)
    if cls is MultiprocExecutor:
        return cls(config, standby)
    return cls(config)


def check_device_available(config: EngineConfig) -> None:
    """Reject, before start-up, a CUDA device this machine does not have (local ranks only)."""
    if config.device is None:
        return
    device = torch.device(config.device)
    why = platform_for(device).missing_device(device, config.world_size)
    if why is not None:
        raise ConfigError(
            f"EngineConfig.device={config.device!r}: {why} ({config.world_size} rank(s), "
            "tensor x pipeline parallel); use device='cpu', a lower index or fewer ranks, "
            "or leave device unset"
        )


__all__ = [
    "BACKENDS",
    "Executor",
    "ExecutorError",
    "MultiprocExecutor",
    "StandbyWorkers",
    "WorkerDiedError",
    "WorkerInfo",
    "executor_class",
    "make_executor",
]
