"""``MultiprocExecutor``: one worker process per rank on this machine.

Workers are spawned (never forked: CUDA and Inductor's compile workers do
not survive a fork), join one ``torch.distributed`` group over a free
loopback TCP port (gloo on CPU, NCCL on CUDA), build their runner and report
ready. Each step the scheduler output is pickled once and the same bytes are
written to every worker's pipe; the sampling rank (the last pipeline stage's first)
alone answers with the sampled tokens.

The driver waits on every pipe and every process sentinel at once, so a
worker that raises (it reports, then exits) or dies (killed, crashed) is
seen at once: the executor raises ``WorkerDiedError`` naming the rank and
the cause, and terminates the other workers, which may be blocked in a
collective waiting for the dead one. A worker that stays silent longer than
``step_timeout_s`` is treated the same way. Workers also die with the driver
(``PR_SET_PDEATHSIG`` on Linux, daemon processes elsewhere). A restart runs the ranks
in standby processes (``standby.py``) where it has them, skipping the imports.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from compile_runtime.config import EngineConfig
from compile_runtime.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from compile_runtime.distributed.parallel_state import LOOPBACK, free_port
from compile_runtime.executor.base import (
    Executor,
    ExecutorError,
    WorkerDiedError,
)
from compile_runtime.executor.standby import StandbyWorkers
from compile_runtime.worker.worker import worker_main

logger = logging.getLogger(__name__)


def _stop_processes(processes: list, conns: list, graceful: bool) -> None:
    """Stop workers: ask politely (when ``graceful``), then SIGTERM, then SIGKILL."""
    if graceful:
        message = pickle.dumps(("shutdown", (), ()))
        for p, conn in zip(processes, conns, strict=True):
            if p.is_alive():
                try:
                    conn.send_bytes(message)
                except OSError:
                    pass
        deadline = time.monotonic() + 10
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()


def death_cause(process: multiprocessing.Process) -> str:
    process.join(1)
    code = process.exitcode
    if code is None:
        return "its pipe closed while the process still runs"
    if code < 0:
        try:
            return f"process {process.pid} was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"process {process.pid} was killed by signal {-code}"
    return f"process {process.pid} exited with code {code}"


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, standby: StandbyWorkers | None = None):
        """``standby``: processes spawned ahead, done importing, to run the ranks in (a
        restart); ranks it has none for are spawned here."""
        self.config = config
        self.closed = False
        world = config.world_size
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://{LOOPBACK}:{free_port()}"
        self.processes: list[multiprocessing.Process] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self._finalizer = weakref.finalize(self, _stop_processes, self.processes, self.conns, False)
        ready = standby.take(world) if standby is not None else []
        for rank in range(world):
            worker_args = (config, rank, world, init_method)
            if rank < len(ready):
                ready[rank].start_worker(worker_args)
                process, parent_end = ready[rank].process, ready[rank].conn
            else:
                parent_end, child_end = ctx.Pipe(duplex=True)
                process = ctx.Process(
                    target=worker_main,
                    args=(*worker_args, child_end, os.getpid()),
                    name=f"compile_runtime-rank{rank}",
                    daemon=True,
                )
                process.start()
                child_end.close()
            self.processes.append(process)
            self.conns.append(parent_end)
        logger.info(
            "started %d workers (%d of them standby processes; %s)", world, len(ready), init_method
        )
        infos = self._wait(range(world), config.startup_timeout_s, "start-up")
        self.workers_info = [infos[r] for r in range(world)]
        self.num_steps = 0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ---- the step ---------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        ranks = range(self.world_size)
        self._send("step", (scheduler_output,), ranks, reply_ranks=(self.output_rank,))

    def sample_tokens(self) -> ModelRunnerOutput:
        output_rank = self.output_rank
        output = self._wait([output_rank], self.config.step_timeout_s, "a step")[output_rank]
        self.num_steps += 1
        return output

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), ranks: Sequence[int] | None = None
    ) -> list[Any]:
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        self._send(method, tuple(args), ranks, reply_ranks=tuple(ranks))
        results = self._wait(ranks, self.config.step_timeout_s, f"{method}()")
        return [results[r] for r in ranks]

    def check_alive(self) -> None:
        if self.closed:
            raise ExecutorError("the executor is shut down (after a failure or shutdown())")
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                raise self._fail(self._dead(rank))

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        _stop_processes(self.processes, self.conns, graceful=True)

    # ---- plumbing ---------------------------------------------------------

    def _send(
        self, method: str, args: tuple, ranks: Iterable[int], reply_ranks: tuple[int, ...]
    ) -> None:
        if self.closed:
            raise ExecutorError("the executor is shut down (after a failure or shutdown())")
        data = pickle.dumps((method, args, reply_ranks), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in ranks:
            try:
                self.conns[rank].send_bytes(data)
            except OSError:
                raise self._fail(self._dead(rank)) from None

    def _wait(self, ranks: Iterable[int], timeout: float, what: str) -> dict[int, Any]:
        """Replies of ``ranks``; any error or death on any rank fails the executor."""
        expected = set(ranks)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while expected - results.keys():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(expected - results.keys())
                raise self._fail(
                    ExecutorError(
                        f"no reply from rank(s) {missing} within {timeout:.0f} s of {what}; "
                        "stopped every worker"
                    )
                )
            failures: dict[int, tuple] = {}
            for rank, kind, payload in self._events(remaining, range(self.world_size)):
                if kind == "ok":
                    results[rank] = payload
                else:
                    failures[rank] = (kind, payload)
            if failures:
                raise self._fail(self._root_cause(failures))
        return results

    def _events(self, timeout: float, ranks: Iterable[int]) -> list[tuple[int, str, Any]]:
        """``(rank, kind, payload)`` for what ``ranks`` did within ``timeout``.

        kind is "ok" (payload: the result), "error" (payload: (time, summary,
        traceback)) or "died" (payload: the cause).
        """
        ranks = list(ranks)
        waitables: dict[Any, tuple[int, bool]] = {}
        for r in ranks:
            waitables[self.conns[r]] = (r, True)
            waitables[self.processes[r].sentinel] = (r, False)
        ready = multiprocessing.connection.wait(list(waitables), timeout=timeout)
        events: list[tuple[int, str, Any]] = []
        seen: set[int] = set()
        # Pipes before sentinels: a worker that failed reported why, then exited.
        for obj in sorted(ready, key=lambda o: not waitables[o][1]):
            rank, is_pipe = waitables[obj]
            if is_pipe:
                seen.add(rank)
                try:
                    message = obj.recv()
                except (EOFError, OSError):
                    events.append((rank, "died", death_cause(self.processes[rank])))
                    continue
                if message[0] == "error":
                    events.append((rank, "error", (message[3], message[1], message[2])))
                else:
                    events.append((rank, "ok", message[1]))
            elif rank not in seen and not self.conns[rank].poll():
                events.append((rank, "died", death_cause(self.processes[rank])))
        return events

    def _root_cause(self, failures: dict[int, tuple], grace_s: float = 1.0) -> WorkerDiedError:
        """The failure that caused the others.

        When one rank dies, its peers fail soon after inside a collective
        ("connection closed by peer"). Gather what else fails within
        ``grace_s``, then blame a rank that died without a word (killed,
        crashed), else the rank whose error came first.
        """
        deadline = time.monotonic() + grace_s
        while len(failures) < self.world_size and time.monotonic() < deadline:
            others = [r for r in range(self.world_size) if r not in failures]
            for rank, kind, payload in self._events(deadline - time.monotonic(), others):
                if kind != "ok":
                    failures[rank] = (kind, payload)
        for rank, (kind, payload) in sorted(failures.items()):
            if kind == "error":
                logger.error("rank %d failed:\n%s", rank, payload[2])
        silent = sorted(r for r, (kind, _) in failures.items() if kind == "died")
        if silent:
            return WorkerDiedError(silent[0], failures[silent[0]][1])
        first = min(failures, key=lambda r: failures[r][1][0])
        return WorkerDiedError(first, failures[first][1][1])

    def _dead(self, rank: int) -> WorkerDiedError:
        return WorkerDiedError(rank, death_cause(self.processes[rank]))

    def _fail(self, error: Exception) -> Exception:
        """Stop every worker at once (some may be stuck in a collective), then hand back ``error``."""
        logger.error("%s; stopping all %d workers", error, self.world_size)
        if not self.closed:
            self.closed = True
            self._finalizer.detach()
            _stop_processes(self.processes, self.conns, graceful=False)
        return error
