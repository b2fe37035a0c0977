"""A worker process one of whose ranks fails mid-generation: the executors' failure path, for real.

``MultiprocExecutor`` spawns each rank with ``worker_main``; a test swaps in
``functools.partial(worker_main, fault=Fault(...))`` from this module (spawn pickles it by
reference, and the new process imports this module: it gets the test process's ``sys.path``).
On the faulty rank the model runner's ``execute_model`` raises ``InjectedFault`` from the chosen
step on; everything after that is the package's own: the worker reports and exits, the driver
names the rank and the cause and stops the other workers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

# The executor's own worker_main, imported the way the package does (compile_runtime.worker.worker
# first would meet the executor package half-imported: worker.worker -> executor -> multiproc).
from compile_runtime.executor.multiproc import worker_main as executor_worker_main
from compile_runtime.worker.model_runner import ModelRunner


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


@dataclass(frozen=True)
class Fault:
    rank: int
    at_step: int  # the first step that fails, counting the rank's steps from 1
    message: str


def worker_main(config: Any, rank: int, *rest: Any, fault: Fault) -> None:
    """The executor's ``worker_main``, its model runner failing on ``fault.rank``."""
    if rank == fault.rank:
        execute = ModelRunner.execute_model
        steps = itertools.count(1)

        def execute_model(self: ModelRunner, scheduler_output: Any) -> None:
            if next(steps) >= fault.at_step:
                raise InjectedFault(fault.message)
            return execute(self, scheduler_output)

        ModelRunner.execute_model = execute_model  # this process is the rank's alone
    executor_worker_main(config, rank, *rest)
