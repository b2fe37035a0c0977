"""The blocking work of preparing a request, off the event loop: tokenizing, chat templates,
output-constraint checks, the engine's checks of a call's requests and LoRA adapter
loading run in a few worker threads (tokenizers and xgrammar release the GIL), each with
a time bound, so that ``/health`` and the other requests answer while one is slow. A pool
of work that runs without the GIL (compiling grammars) may run at a lower CPU priority
(``niceness``, where the OS sets it per thread) so that it yields the cores to the event
loop and the engine; a pool of Python work stays at the loop's priority: a thread that
holds the GIL and waits for a core would keep the loop waiting too.

A job past its bound is a 400 naming the field that made it slow (the request is answered
at once); one that waited for a free worker past the bound is a 503 (the server is busy:
retry). A job run with ``interrupt`` (Python-level work, such as rendering a template) is
stopped at its bound: ``JobInterrupted`` is raised in its thread at the next bytecode; any
other finishes on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from compile_runtime.server.api_error import APIError

T = TypeVar("T")

WORKERS = 4
PREPARE_SECONDS = 20.0
NICENESS = 10


class JobInterrupted(BaseException):
    """Raised in a worker thread whose interruptible job ran past its bound."""


class _Job:
    def __init__(self, fn: Callable[[], Any], interruptible: bool):
        self.future: Future = Future()
        self.fn = fn
        self.interruptible = interruptible
        self.thread_id: int | None = None  # while it runs
        self.lock = threading.Lock()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # its request gave up waiting
        with self.lock:
            self.thread_id = threading.get_ident()
        try:
            result, error = self.fn(), None
        except BaseException as e:  # noqa: BLE001 - the request's to report
            result, error = None, e
        with self.lock:
            self.thread_id = None
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)

    def interrupt(self) -> None:
        with self.lock:
            if self.interruptible and self.thread_id is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread_id), ctypes.py_object(JobInterrupted)
                )


class WorkerPool:
    """``workers`` daemon threads (a job past its bound may run on, but never keeps the
    process from exiting), started on first use."""

    def __init__(
        self, workers: int = WORKERS, timeout_s: float = PREPARE_SECONDS, niceness: int = 0
    ):
        self.workers = workers
        self.niceness = niceness
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _work(self) -> None:
        if self.niceness:
            with contextlib.suppress(AttributeError, OSError):  # Linux: per thread
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.niceness)
        while (job := self._jobs.get()) is not None:
            try:
                job.run()
            except JobInterrupted:  # it arrived after the job's own code: the thread goes on
                if not job.future.done():
                    job.future.set_exception(JobInterrupted())

    def _start(self) -> None:
        with self._lock:
            while len(self._threads) < self.workers:
                thread = threading.Thread(
                    target=self._work, name=f"server-prepare-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        what: str,
        param: str | None,
        interrupt: bool = False,
        **kwargs: Any,
    ) -> T:
        """``fn(*args, **kwargs)`` in a worker; ``what``: the work, as the error names it;
        ``interrupt``: stop it at the bound (Python-level work only)."""
        if len(self._threads) < self.workers:
            self._start()
        job = _Job(lambda: fn(*args, **kwargs), interrupt)
        self._jobs.put(job)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job.future), self.timeout_s)
        except TimeoutError:
            if job.future.cancel():  # never started: every worker was busy
                raise APIError(
                    503, "the server is busy preparing other requests; retry shortly"
                ) from None
            job.interrupt()
            where = f"{param}: " if param else ""
            raise APIError(
                400,
                f"{where}{what} took more than {self.timeout_s:g} s, the most this server "
                "gives one request (--max-prepare-seconds); send less",
                param,
            ) from None

    def shutdown(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
