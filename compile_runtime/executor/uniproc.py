"""``UniProcExecutor``: the one runner lives in the calling process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from compile_runtime.config import EngineConfig
from compile_runtime.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from compile_runtime.executor.base import Executor, ExecutorError
from compile_runtime.worker.model_runner import ModelRunner
from compile_runtime.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"UniProcExecutor runs one rank; tensor_parallel_size="
                f"{config.tensor_parallel_size} needs the 'mp' or 'ray' executor"
            )
        self.config = config
        self.worker = Worker(config, rank=0, world_size=1, init_method=None)
        self.workers_info = [self.worker.start()]
        self._shut_down = False

    @property
    def driver_runner(self) -> ModelRunner:
        return self.worker.runner

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self._shut_down:
            raise ExecutorError("the executor is shut down (after shutdown()); start a new LLM")
        # The runner itself, as the worker's step would call it: one rank, which samples.
        self.worker.runner.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.worker.runner.sample_tokens()

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), ranks: Sequence[int] | None = None
    ) -> list[Any]:
        return [getattr(self.worker, method)(*args) for _ in (ranks if ranks is not None else [0])]

    def shutdown(self) -> None:
        """Give back the KV cache and graphs at once (a second engine in this process gets them)."""
        if not self._shut_down:
            self._shut_down = True
            self.worker.runner.release()  # no process group of its own to leave
