"""Bounds on what one request may ask, so that no number a client sends decides how much
the server allocates: the body's size (``--max-request-body-bytes``, a 413 before it is
read past the bound), the prompts of one completion call (``--max-prompts-per-request``)
and the choices it asks the engine for, prompts times ``n`` (``--max-choices-per-request``);
and the bytes of large bodies (1 MiB or more) being read and decoded at once
(``--max-body-bytes-in-flight``): past it, a large body waits for others to finish, and
after ``BODY_WAIT_SECONDS`` is a 503; when the last large body is done, the C heap gives
its free memory back to the OS (glibc's ``malloc_trim``), so RSS returns after a burst.
Each refusal is a 4xx naming the field and the flag
that raises the bound."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import json
from dataclasses import dataclass
from typing import Any

from compile_runtime.server.api_error import APIError, error_body
from compile_runtime.server.protocol import CompletionRequest, SamplingFields


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 16 << 20
    max_prompts: int = 2048  # OpenAI's bound on a completion's prompt array
    max_choices: int = 256
    max_body_bytes_in_flight: int = 64 << 20
    prepare_seconds: float = 20.0  # worker_pool.py: each step of preparing a request

    def check(self, body: SamplingFields) -> None:
        """A 400 for a call over the bounds, before anything is built per prompt or choice."""
        prompts = 1
        if isinstance(body, CompletionRequest) and isinstance(body.prompt, list):
            if body.prompt and not isinstance(body.prompt[0], int):
                prompts = len(body.prompt)
        if prompts > self.max_prompts:
            raise APIError(
                400,
                f"prompt: {prompts} prompts in one request, more than the "
                f"{self.max_prompts} this server takes (--max-prompts-per-request); "
                "split the call",
                "prompt",
            )
        if prompts * body.num_choices > self.max_choices:
            raise APIError(
                400,
                f"n: {body.num_choices} choice(s) for each of {prompts} prompt(s) is "
                f"{prompts * body.num_choices}, more than the {self.max_choices} one request "
                "may ask for (--max-choices-per-request); lower n or split the call",
                "n",
            )


class BodyTooLarge(BaseException):
    """Raised from ``receive`` past the bound; a BaseException, so that no handler on the
    way (FastAPI turns a body that fails to read into a 400) mistakes it for a bad body."""


LARGE_BODY = 1 << 20
BODY_WAIT_SECONDS = 30.0


@functools.cache
def _libc() -> Any:
    """The C library, looked up once (``find_library`` runs ``ldconfig``, a process)."""
    with contextlib.suppress(OSError):
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return None


def _malloc_trim() -> None:
    with contextlib.suppress(AttributeError, TypeError):
        _libc().malloc_trim(0)


class ByteBudget:
    """A semaphore counted in bytes (the large bodies being handled at once)."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0
        self._freed: asyncio.Condition | None = None

    async def acquire(self, n: int, timeout: float) -> bool:
        n = min(n, self.total)  # one body alone always fits
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            try:
                await asyncio.wait_for(
                    self._freed.wait_for(lambda: self.used + n <= self.total), timeout
                )
            except TimeoutError:
                return False
            self.used += n
            return True

    async def release(self, n: int) -> None:
        n = min(n, self.total)
        assert self._freed is not None
        async with self._freed:
            self.used -= n
            self._freed.notify_all()


class BodySizeLimit:
    """ASGI middleware: a 413 for a body over ``max_bytes``, by its Content-Length or, for
    a chunked one, as soon as the bytes read pass the bound; large bodies wait for their
    share of ``in_flight`` bytes (a chunked one counts as ``max_bytes``)."""

    def __init__(self, app: Any, max_bytes: int, in_flight: int = 64 << 20):
        self.app = app
        self.max_bytes = max_bytes
        self.budget = ByteBudget(in_flight)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, length.decode("latin-1")[:30])
            return
        size = int(length) if length.isdigit() else 0
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            size = self.max_bytes
        if size < LARGE_BODY:
            await self._handle(scope, receive, send)
            return
        held = await self.budget.acquire(size, BODY_WAIT_SECONDS)
        if not held:
            message = (
                "the server is reading as many large request bodies as it takes at once "
                "(--max-body-bytes-in-flight); retry shortly"
            )
            await self._send(send, 503, error_body(503, message))
            return

        async def release() -> None:  # when the answer starts: the body is decoded by then
            nonlocal held
            if held:
                held = False
                await self.budget.release(size)

        try:
            await self._handle(scope, receive, send, release)
        finally:
            await release()
            if self.budget.used == 0:  # the burst is over: its heap back to the OS
                await asyncio.get_running_loop().run_in_executor(None, _malloc_trim)

    async def _handle(self, scope: dict, receive: Any, send: Any, on_start: Any = None) -> None:
        read = 0
        started = False

        async def bounded_receive() -> dict:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_bytes:
                raise BodyTooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and on_start is not None:
                await on_start()
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, f"more than {self.max_bytes}")

    async def _refuse(self, send: Any, got: str) -> None:
        message = (
            f"the request body is {got} bytes; this server takes at most {self.max_bytes} "
            "(--max-request-body-bytes)"
        )
        await self._send(send, 413, error_body(413, message))

    async def _send(self, send: Any, status: int, body: dict) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
