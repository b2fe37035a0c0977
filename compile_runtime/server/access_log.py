"""One INFO line per HTTP request once its response has been sent (a stream: at its end):
client, method, path, status, prompt and completion tokens, seconds, as uvicorn's access
log reads with the tokens added. Logger ``compile_runtime.server.access``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("compile_runtime.server.access")


@dataclass
class TokenCounts:
    """A request's tokens, filled by its handler (``request.state.tokens``)."""

    prompt: int = 0
    choices: Sequence[Any] = ()  # with ``token_ids``, counted when the response ends

    @property
    def completion(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class AccessLog:
    """ASGI middleware: times each HTTP request and logs it when its last byte is sent."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        tokens = TokenCounts()
        scope.setdefault("state", {})["tokens"] = tokens
        status = 500  # unless a response starts
        logged = False

        def log() -> None:
            nonlocal logged
            if logged:
                return
            logged = True
            client = scope.get("client") or ("-", 0)
            logger.info(
                '%s:%s "%s %s" %d prompt_tokens=%d completion_tokens=%d %.3fs',
                client[0], client[1], scope["method"], scope["path"], status,
                tokens.prompt, tokens.completion, time.perf_counter() - start,
            )  # fmt: skip

        async def send_and_log(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                log()

        try:
            await self.app(scope, receive, send_and_log)
        finally:
            log()  # a client that went away mid-stream: logged all the same
