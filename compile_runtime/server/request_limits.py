"""Bounds on what one request may ask, so that no number a client sends decides how much
the server allocates: the body's size (``--max-request-body-bytes``, a 413 before it is
read past the bound), the prompts of one completion call (``--max-prompts-per-request``)
and the choices it asks the engine for, prompts times ``n`` (``--max-choices-per-request``).
Each refusal is a 4xx naming the field and the flag that raises the bound."""

from __future__ import annotations

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


class BodySizeLimit:
    """ASGI middleware: a 413 for a body over ``max_bytes``, by its Content-Length or, for
    a chunked one, as soon as the bytes read pass the bound."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, length.decode("latin-1")[:30])
            return
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
        body = json.dumps(error_body(413, message)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
