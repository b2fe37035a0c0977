"""The executor interface: how the engine reaches its model runner(s).

The scheduler loop calls ``execute_model(scheduler_output)`` then
``sample_tokens()`` and never learns how many workers there are: one runner
in this process (``UniProcExecutor``), one worker process per rank on this
machine (``MultiprocExecutor``), or Ray actors that may live on several
machines (``RayExecutor``). Start-up (load, compile, KV cache, capture)
happens in the constructor; ``shutdown()`` stops every worker.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import ConfigDict, Field, field_validator

from compile_runtime.config import CompilationConfig
from compile_runtime.runner.model_runner import CheckedConfig, ConfigError, RunnerConfig
from compile_runtime.runner.scheduler_output import ModelRunnerOutput, SchedulerOutput

BACKENDS = ("uni", "mp", "ray")


class ExecutorError(RuntimeError):
    """The executor cannot start or cannot go on."""


class WorkerDiedError(ExecutorError):
    """A worker died or failed; the message names the rank and the cause."""

    def __init__(self, rank: int, cause: str):
        super().__init__(f"rank {rank} died: {cause}")
        self.rank = rank
        self.cause = cause


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class EngineConfig(CheckedConfig):
    """Everything a worker needs to build its runner (plain data: it travels to workers)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model_dir: str
    compilation_config: CompilationConfig
    runner_config: RunnerConfig
    dtype: torch.dtype = torch.float32
    device: str | None = None  # None: CUDA when available, else CPU
    use_transformers: bool = False
    tensor_parallel_size: int = Field(1, ge=1, description="ranks the model is split over")
    # Seconds a step may take before the driver gives up on a silent (hung) worker.
    step_timeout_s: float = Field(600.0, gt=0, description="seconds one step may take")
    # Seconds start-up (load, compile, capture) may take on any rank.
    startup_timeout_s: float = Field(1800.0, gt=0, description="seconds start-up may take")
    # Environment variables set in every worker (Ray workers do not inherit the driver's).
    worker_env: dict[str, str] = Field(default_factory=dict)

    @field_validator("dtype")
    @classmethod
    def _float_dtype(cls, v: torch.dtype) -> torch.dtype:
        if v not in DTYPES:
            raise ValueError(f"dtype {v} is not one of {', '.join(map(str, DTYPES))}")
        return v

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            kind = torch.device(v).type
        except RuntimeError:  # not a device string at all
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {v!r}; use 'cpu', 'cuda' or 'cuda:N', or None")
        return v


def check_device_available(config: EngineConfig) -> None:
    """Reject, before start-up, a CUDA device this machine does not have (local ranks only)."""
    if config.device is None or torch.device(config.device).type != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
        raise ConfigError(
            f"EngineConfig.device={config.device!r}: CUDA is not available here (torch "
            f"{torch.__version__}, a {build} build); use device='cpu' or leave device unset"
        )
    index = torch.device(config.device).index
    last = index if index is not None else config.tensor_parallel_size - 1
    if last >= torch.cuda.device_count():
        raise ConfigError(
            f"EngineConfig.device={config.device!r} with tensor_parallel_size="
            f"{config.tensor_parallel_size} needs GPU {last}, but this machine has "
            f"{torch.cuda.device_count()}; use a lower index or fewer ranks"
        )


@dataclass
class WorkerInfo:
    """What a worker reports once started."""

    rank: int
    pid: int
    hostname: str
    num_blocks: int
    load_seconds: float
    compile_seconds: float
    counters: dict[str, int]  # compilation_counter changes during start-up


def counter_snapshot() -> dict[str, int]:
    from compile_runtime.compiler.counters import compilation_counter

    return dataclasses.asdict(compilation_counter)


class Executor(abc.ABC):
    """Runs the model on every rank, one scheduler step at a time."""

    config: EngineConfig
    workers_info: list[WorkerInfo]
    # False where ranks may run on other machines (Ray): this one's devices say nothing.
    local_ranks: ClassVar[bool] = True

    @property
    def world_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def num_blocks(self) -> int:
        """KV cache blocks the scheduler may hand out: the least any rank has."""
        return min(info.num_blocks for info in self.workers_info)

    @property
    def load_seconds(self) -> float:
        return max(info.load_seconds for info in self.workers_info)

    @property
    def compile_seconds(self) -> float:
        return max(info.compile_seconds for info in self.workers_info)

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Send one step to every rank (each applies it and runs the forward)."""

    @abc.abstractmethod
    def sample_tokens(self) -> ModelRunnerOutput:
        """The step's sampled tokens (from rank 0); raises ``WorkerDiedError`` on a failure."""

    @abc.abstractmethod
    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), ranks: Sequence[int] | None = None
    ) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on the given ranks (all by default); results by rank."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; safe to call twice."""

    def workload(self):
        """The step-size histogram rank 0 recorded."""
        return self.collective_rpc("workload", ranks=[0])[0]

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def executor_class(backend: str | None, tensor_parallel_size: int) -> type[Executor]:
    """The executor for ``distributed_executor_backend`` (None: "uni" on one rank, else "mp")."""
    if backend is None:
        backend = "uni" if tensor_parallel_size == 1 else "mp"
    if backend not in BACKENDS:
        raise ValueError(f"distributed_executor_backend={backend!r} is not one of {list(BACKENDS)}")
    if backend == "uni":
        if tensor_parallel_size != 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank in this process; "
                f"tensor_parallel_size={tensor_parallel_size} needs 'mp' or 'ray'"
            )
        from compile_runtime.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from compile_runtime.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    from compile_runtime.executor.ray_executor import RayExecutor, import_ray

    import_ray()  # fails here, naming what to install, when ray is missing
    return RayExecutor


# Variables that steer compilation and the cache: workers see what the driver sees.
FORWARDED_ENV_PREFIXES = ("COMPILE_RUNTIME_", "TORCHINDUCTOR_", "TRITON_")


def check_model(config: EngineConfig) -> None:
    """Reject, before any worker starts, a model this configuration cannot run."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(config.model_dir)
    config.runner_config.check_model(hf_config, config.model_dir)
    check_model_for_tensor_parallel(config, hf_config)


def check_model_for_tensor_parallel(config: EngineConfig, hf_config: Any) -> None:
    """Reject a model that cannot run on ``tensor_parallel_size`` ranks."""
    if config.tensor_parallel_size == 1:
        return
    from compile_runtime.distributed.sharding import (
        TensorParallelConfigError,
        check_tensor_parallel,
    )
    from compile_runtime.models.llama import ARCHITECTURES

    if config.use_transformers or hf_config.model_type not in ARCHITECTURES:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={config.tensor_parallel_size} needs a native model "
            f"({sorted(ARCHITECTURES)}); {hf_config.model_type!r}"
            f"{' through the transformers adapter' if config.use_transformers else ''} runs on "
            "one rank only"
        )
    check_tensor_parallel(hf_config, config.tensor_parallel_size)


def make_executor(config: EngineConfig, backend: str | None = None) -> Executor:
    """Check the configuration, then start the executor (and through it every worker)."""
    cls = executor_class(backend, config.tensor_parallel_size)
    if cls.local_ranks:
        check_device_available(config)
    check_model(config)
    if not config.worker_env:
        config.worker_env = {
            k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)
        }
    return cls(config)
