"""One rank: its process group membership, its model runner, its step loop.

``Worker`` is the same object under every executor (in this process, in a
spawned process, in a Ray actor). ``worker_main`` is the entry point of a
``MultiprocExecutor`` process: start up, report, then serve one message per
step from the driver's pipe until told to stop or the driver goes away.

Message protocol on the pipe (driver -> worker), pickled once per step by
the driver and written to every worker: ``(method, args, reply_ranks)``.
Worker -> driver: ``("ready", WorkerInfo)``, ``("ok", result)`` when this
rank is in ``reply_ranks``, ``("error", summary, traceback, time)`` on any
failure, after which the worker exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from compile_runtime.config import EngineConfig
from compile_runtime.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from compile_runtime.counters import compilation_counter
from compile_runtime.device import default_device
from compile_runtime.distributed import default_backend, init_distributed, sampling_rank
from compile_runtime.platforms.select import platform_for
from compile_runtime.worker.model_runner import ModelRunner
from compile_runtime.worker.startup import StartupTimes

logger = logging.getLogger(__name__)

WORKER_PROCESS_PREFIX = "cr-rank"  # /proc/PID/comm of rank N's process: cr-rankN


def counter_snapshot() -> dict[str, int]:
    """This process's compilation counters (a worker reports what its start-up did)."""
    return dataclasses.asdict(compilation_counter)


@dataclass
class WorkerInfo:
    """What a worker reports once started."""

    rank: int
    pid: int
    hostname: str
    num_blocks: int
    startup: StartupTimes
    counters: dict[str, int]  # compilation_counter changes during start-up


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        world_size: int,
        init_method: str | None,
        local_rank: int | None = None,
    ):
        self.config = config  # whole, as the engine decided it (the model's config in it)
        self.rank = rank
        self.world_size = world_size
        self.init_method = init_method
        self.local_rank = rank if local_rank is None else local_rank
        self.runner = None
        self.answers_steps = rank == 0  # the sampling rank: set once the group is known

    def device(self) -> str:
        """This rank's device: ``cuda:<local rank>`` when several ranks share a machine's GPUs."""
        device = self.config.device or default_device()
        if self.world_size > 1:
            return platform_for(device).rank_device(device, self.local_rank)
        return device

    def start(self) -> WorkerInfo:
        """Join the group, load this rank's weights, compile, size the KV cache, capture."""
        before = counter_snapshot()
        device = self.device()
        platform_for(device).set_device(torch.device(device))
        if self.init_method is not None:
            init_distributed(
                self.rank,
                self.world_size,
                self.init_method,
                backend=default_backend(device),
                pipeline_parallel_size=self.config.pipeline_parallel_size,
                pipeline_layer_partition=self.config.pipeline_layer_partition,
            )
        c = self.config
        self.runner = ModelRunner(
            c.model_dir,
            c.compilation_config,
            c.runner_config,
            capture_sizes=c.cudagraph_capture_sizes,
            dtype=c.dtype,
            device=device,
            use_transformers=c.use_transformers,
            hf_config=c.hf_config,
        )
        self.runner.initialize()
        self.answers_steps = self.rank == sampling_rank()
        after = counter_snapshot()
        return WorkerInfo(
            rank=self.rank,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            num_blocks=self.runner.num_blocks,
            startup=self.runner.startup,
            counters={k: after[k] - before[k] for k in after},
        )

    def step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply one scheduler step and sample; only the sampling rank returns the tokens."""
        self.runner.execute_model(scheduler_output)
        output = self.runner.sample_tokens()
        return output if self.answers_steps else None

    def workload(self):
        return self.runner.workload

    def shutdown(self) -> None:
        """Release the runner's KV cache and graphs, then leave the process group."""
        from compile_runtime.distributed import destroy_distributed

        if self.runner is not None:
            self.runner.release()
        destroy_distributed()


def error_summary(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _prctl(option: int, arg: int | bytes) -> None:
    """Linux's prctl(2), where there is one; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)
    except OSError:
        pass


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the driver dies, so no worker is orphaned."""
    _prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def name_process(name: str) -> None:
    """Linux: ``name`` (15 bytes at most) as /proc/PID/comm, so that ``ps -o comm`` and
    tools tell the workers and standby processes apart."""
    _prctl(15, name.encode()[:15])  # PR_SET_NAME


def worker_main(
    config: EngineConfig,
    rank: int,
    world_size: int,
    init_method: str,
    conn: Any,
    parent_pid: int,
) -> None:
    """Entry point of one ``MultiprocExecutor`` worker process."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the driver stops us
    if os.getppid() != parent_pid:  # the driver died before we set the signal
        return
    name_process(f"{WORKER_PROCESS_PREFIX}{rank}")
    os.environ.update(config.worker_env)
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s"
    )
    worker = Worker(config, rank, world_size, init_method)
    try:
        start = time.perf_counter()
        info = worker.start()
        logger.info("rank %d ready in %.1f s", rank, time.perf_counter() - start)
        conn.send(("ready", info))
    except BaseException as e:  # report, then exit: the driver names the rank and the cause
        _report(conn, e)
        os._exit(1)
    while True:
        try:
            method, args, reply_ranks = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver is gone
            os._exit(0)
        if method == "shutdown":
            break
        try:
            result = getattr(worker, method)(*args)
            if rank in reply_ranks:
                conn.send(("ok", result))
        except BaseException as e:
            _report(conn, e)
            os._exit(1)
    try:
        worker.shutdown()
    finally:
        conn.close()


def _report(conn: Any, e: BaseException) -> None:
    try:
        conn.send(("error", error_summary(e), traceback.format_exc(), time.time()))
        conn.close()
    except OSError:
        pass
