"""Executors: how the engine reaches the model runner on every rank."""

from compile_runtime.executor.base import (
    BACKENDS,
    EngineConfig,
    Executor,
    ExecutorError,
    WorkerDiedError,
    WorkerInfo,
    executor_class,
    make_executor,
)

__all__ = [
    "BACKENDS",
    "EngineConfig",
    "Executor",
    "ExecutorError",
    "WorkerDiedError",
    "WorkerInfo",
    "executor_class",
    "make_executor",
]
