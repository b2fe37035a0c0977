"""The executor interface: how the engine reaches its model runner(s) (``make_executor``
in ``executor/__init__.py`` picks and starts one).

The scheduler loop calls ``execute_model(scheduler_output)`` then
``sample_tokens()`` and never learns how many workers there are: one runner
in this process (``UniProcExecutor``), one worker process per rank on this
machine (``MultiprocExecutor``), or Ray actors that may live on several
machines (``RayExecutor``). Start-up (load, compile, KV cache, capture)
happens in the constructor; ``shutdown()`` stops every worker.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

from compile_runtime.config import EngineConfig
from compile_runtime.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from compile_runtime.worker.model_runner import ModelRunner
from compile_runtime.worker.startup import StartupTimes
from compile_runtime.worker.worker import WorkerInfo


class ExecutorError(RuntimeError):
    """The executor cannot start or cannot go on."""


class WorkerDiedError(ExecutorError):
    """A worker died or failed; the message names the rank and the cause."""

    def __init__(self, rank: int, cause: str):
        super().__init__(f"rank {rank} died: {cause}")
        self.rank = rank
        self.cause = cause


class Executor(abc.ABC):
    """Runs the model on every rank, one scheduler step at a time."""

    config: EngineConfig
    workers_info: list[WorkerInfo]
    # False where ranks may run on other machines (Ray): this one's devices say nothing.
    local_ranks: ClassVar[bool] = True

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def output_rank(self) -> int:
        """The rank that samples and answers each step: the last stage's first rank."""
        return self.world_size - self.config.tensor_parallel_size

    @property
    def num_blocks(self) -> int:
        """KV cache blocks the scheduler may hand out: the least any rank has."""
        return min(info.num_blocks for info in self.workers_info)

    @property
    def startup(self) -> StartupTimes:
        """The start-up of the slowest rank."""
        return max((info.startup for info in self.workers_info), key=lambda t: t.total)

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Send one step to every rank (each applies it and runs the forward)."""

    @abc.abstractmethod
    def sample_tokens(self) -> ModelRunnerOutput:
        """The step's sampled tokens (from ``output_rank``); raises ``WorkerDiedError`` on a failure."""

    @abc.abstractmethod
    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), ranks: Sequence[int] | None = None
    ) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on the given ranks (all by default); results by rank."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; safe to call twice."""

    def check_alive(self) -> None:
        """Raise ``ExecutorError`` when a worker is gone; the engine asks while it idles, so a
        death between requests is seen at once (the default: nothing to check)."""
        return None

    @property
    def driver_runner(self) -> ModelRunner | None:
        """Rank 0's model runner when it lives in this process, else None."""
        return None

    def workload(self):
        """The step-size histogram rank 0 recorded."""
        return self.collective_rpc("workload", ranks=[0])[0]

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
