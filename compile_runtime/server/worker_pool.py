"""The blocking work of preparing a request, off the event loop: tokenizing, chat templates,
output-constraint checks, the engine's checks of a call's requests and LoRA adapter
loading run in a few worker threads (tokenizers and xgrammar release the GIL), each with
a time bound, so that ``/health`` and the other requests answer while one is slow.

A job past its bound is a 400 naming the field that made it slow (its thread finishes on
its own; the request is answered at once); one that waited for a free worker past the
bound is a 503 (the server is busy: retry).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from compile_runtime.server.api_error import APIError

T = TypeVar("T")

WORKERS = 4
PREPARE_SECONDS = 20.0


class WorkerPool:
    def __init__(self, workers: int = WORKERS, timeout_s: float = PREPARE_SECONDS):
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="server-prepare")

    async def run(
        self, fn: Callable[..., T], *args: Any, what: str, param: str | None, **kwargs: Any
    ) -> T:
        """``fn(*args, **kwargs)`` in a worker; ``what``: the work, as the error names it."""
        started = threading.Event()

        def job() -> T:
            started.set()
            return fn(*args, **kwargs)

        future = asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(job))
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            if not started.is_set():
                raise APIError(
                    503, "the server is busy preparing other requests; retry shortly"
                ) from None
            where = f"{param}: " if param else ""
            raise APIError(
                400,
                f"{where}{what} took more than {self.timeout_s:g} s, the most this server "
                "gives one request (--max-prepare-seconds); send less",
                param,
            ) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
