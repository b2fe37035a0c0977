"""Who may use the server: ``--api-key`` (or ``VLLM_API_KEY`` / ``COMPILE_RUNTIME_API_KEY``).

With a key set, every route but the probes an orchestrator polls (``/health``, ``/ping``,
``/metrics``, ``/version``, open as in vLLM) needs ``Authorization: Bearer KEY``; anything
else is a 401 in OpenAI's error shape. Keys are compared as SHA-256 digests with
``hmac.compare_digest``, every key every time, so the answer's timing says nothing about
how much of a guess was right. CORS preflights (``OPTIONS``) pass, so that a browser can ask.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Sequence
from typing import Any

from compile_runtime.server.api_error import error_body

ENV_VARIABLES = ("VLLM_API_KEY", "COMPILE_RUNTIME_API_KEY")
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


def api_keys(given: Sequence[str] | None, environ: dict[str, str] | None = None) -> list[str]:
    """The keys of ``--api-key`` and, when none is given, of the environment."""
    environ = os.environ if environ is None else environ
    keys = list(given or []) or [environ[v] for v in ENV_VARIABLES if environ.get(v)]
    if any(not k.strip() for k in keys):
        raise ValueError("--api-key: an empty key would let anyone in; give a non-empty key")
    return keys


def _digest(text: str | bytes) -> bytes:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).digest()


class ApiKeyAuth:
    """ASGI middleware: a 401 for a request without one of ``keys`` as its bearer token."""

    def __init__(self, app: Any, keys: Sequence[str]):
        self.app = app
        self.digests = [_digest(k) for k in keys]

    def allows(self, authorization: bytes) -> bool:
        scheme, _, token = authorization.partition(b" ")
        given = _digest(token.strip())
        matches = [hmac.compare_digest(given, d) for d in self.digests]  # all, no early exit
        return scheme.lower() == b"bearer" and any(matches)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or scope["path"] in OPEN_PATHS
            or self.allows(dict(scope["headers"]).get(b"authorization", b""))
        ):
            await self.app(scope, receive, send)
            return
        message = (
            "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' "
            "with a key the server was started with (--api-key)"
        )
        body = json.dumps(error_body(401, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
