"""The error a request handler raises, and the OpenAI-shaped body it becomes.

Apart from ``errors`` (which installs the handlers on the app) so that code which only
refuses a request, such as the request limits the command line reads, needs no web
framework installed."""

from __future__ import annotations

import logging
import uuid
from typing import Any

logger = logging.getLogger("compile_runtime.server.errors")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {404: "not_found_error", 503: "overloaded_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def internal_error(what: str, exc: BaseException | None = None) -> dict[str, Any]:
    """The body of a 500: a generic message and a request id, never the exception's text;
    the log gets ``what`` (and ``exc``'s traceback) under the same id."""
    request_id = uuid.uuid4().hex[:16]
    logger.error("internal error %s: %s", request_id, what, exc_info=exc)
    message = f"internal server error (request id {request_id}); the server's log has the details"
    return error_body(500, message)
