"""Standby worker processes: spawned, and done importing, before they are needed.

A fresh worker process spends seconds before it can load the model: the interpreter
starts and imports torch, Inductor and transformers (to unpickle the model's config).
After a worker dies under a server, that is half the downtime. ``StandbyWorkers`` keeps
one spawned process per rank that has done those imports and waits on its pipe for the
arguments of ``worker_main``; ``MultiprocExecutor`` takes them instead of spawning, and
the pool spawns fresh ones once the new workers are ready. An idle standby costs the
memory of its imports (a few hundred MB on CPU, much of it shared libraries) and no CPU.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import weakref
from dataclasses import dataclass
from typing import Any

from compile_runtime.config import EngineConfig
from compile_runtime.torch_internals import INDUCTOR_PRELOAD
from compile_runtime.worker.worker import die_with_parent, name_process, worker_main

logger = logging.getLogger(__name__)

STANDBY_PROCESS_NAME = "cr-standby"  # /proc/PID/comm, as ps -o comm shows it
# Beyond what importing this module (worker.worker, the model runner, torch) already loads.
PRELOADED = INDUCTOR_PRELOAD


@dataclass
class StandbyProcess:
    process: multiprocessing.Process
    conn: multiprocessing.connection.Connection  # the driver's end; the worker's pipe later

    def start_worker(self, worker_args: tuple) -> None:
        """Hand over ``worker_main``'s arguments up to (not including) its pipe."""
        try:
            self.conn.send(worker_args)
        except OSError:  # it died just now: the executor's start-up wait names the rank
            pass


def standby_main(conn: Any, parent_pid: int, preload: tuple[str, ...]) -> None:
    """Entry point of a standby process: import, wait for the worker's arguments, become it."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent_pid:
        return
    name_process(STANDBY_PROCESS_NAME)
    for module in preload:
        importlib.import_module(module)
    try:
        worker_args = conn.recv()
    except (EOFError, OSError):  # the pool let us go, or the driver is gone
        os._exit(0)
    worker_main(*worker_args, conn, parent_pid)


def _stop(idle: list[StandbyProcess]) -> None:
    """A standby holds nothing yet: SIGTERM, even mid-import, loses no work."""
    for standby in idle:
        standby.conn.close()
        standby.process.terminate()
    for standby in idle:
        standby.process.join(5)
        if standby.process.is_alive():
            standby.process.kill()
            standby.process.join()
    idle.clear()


class StandbyWorkers:
    def __init__(self, count: int, config: EngineConfig):
        """Keep ``count`` standby processes (one per rank of every engine), ready to unpickle
        ``config`` (the model's config in it)."""
        self.count = count
        self.preload = (*PRELOADED, type(config.hf_config).__module__)
        self.idle: list[StandbyProcess] = []
        self.spawned = 0  # over the pool's life
        self._finalizer = weakref.finalize(self, _stop, self.idle)

    def take(self, n: int) -> list[StandbyProcess]:
        """Up to ``n`` standby processes that are still alive; the pool no longer owns them."""
        alive = [s for s in self.idle if s.process.is_alive()]
        for dead in (s for s in self.idle if s not in alive):
            logger.warning("a standby worker process died (exit code %s)", dead.process.exitcode)
            dead.conn.close()
        taken = alive[:n]
        self.idle[:] = alive[n:]
        return taken

    def fill(self) -> None:
        """Spawn standby processes until ``count`` wait (they import in the background)."""
        ctx = multiprocessing.get_context("spawn")
        while len(self.idle) < self.count:
            parent_end, child_end = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=standby_main,
                args=(child_end, os.getpid(), self.preload),
                name="compile_runtime-standby",
                daemon=True,
            )
            process.start()
            child_end.close()
            self.idle.append(StandbyProcess(process, parent_end))
            self.spawned += 1

    def close(self) -> None:
        self._finalizer()
