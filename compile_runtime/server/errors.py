"""OpenAI-shaped errors: every failure answers an ``{"error": ...}`` body, and a bad
request is a 400, never a 500."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}.get(
        status, "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def add_error_handlers(app: FastAPI) -> None:
    """Our errors, pydantic's request checks (400) and anything unexpected (500) as bodies."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(e)
        return JSONResponse(error_body(400, message, where or None), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"{type(e).__name__}: {e}"), status_code=500)
