"""OpenAI-shaped errors (``{"error": {"message", "type", "param", "code"}}``, as vLLM's
``ErrorResponse``) on every path: ours, an unknown route or method, a body that is not
JSON or not valid, and anything unexpected (a 500). A bad request is a 400, never a 500,
and its message names the field the user sent. A 500 carries no exception text: a generic
message and a request id, under which the log has the traceback."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from compile_runtime.server.api_error import APIError, error_body, internal_error


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


_TYPES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after"})


def field_path(loc: tuple) -> str:
    """pydantic's location as the user's field (``messages.0.role``): without ``body`` and
    the names pydantic gives the branches of a union (``str``, ``list[int]``)."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(p for p in parts if not any(c in p for c in "[](){}") and p not in _TYPES)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """The message and ``param`` for pydantic's errors of a request body."""
    if not errors:
        return "the request body is not valid", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({why}); send a JSON object", None
    where = field_path(first.get("loc", ()))
    if not where:
        if first.get("type") == "missing":
            return "the request body is missing; send a JSON object", None
        return f"the request body must be a JSON object ({first.get('msg')})", None
    # A union's branches each fail on their own: say every way the value could have been.
    why = list(
        dict.fromkeys(
            e["msg"].removeprefix("Value error, ")
            for e in errors
            if field_path(e.get("loc", ())) == where
        )
    )
    message = f"{where}: {' or '.join(why)}"
    got = first.get("input")
    if first.get("type") != "missing" and isinstance(got, str | int | float | bool):
        message += f" (got {repr(got)[:80]})"
    return message, where


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(400, *validation_message(list(e.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        route = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            paths = sorted({r.path for r in app.routes if isinstance(r, APIRoute)})
            message = f"{route}: no such route; this server has {', '.join(paths)}"
        elif e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            message = f"{route}: method not allowed; use {allowed}"
        else:
            message = f"{route}: {e.detail}"
        return error_response(e.status_code, message)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        what = f"{request.method} {request.url.path}: {type(e).__name__}"
        return JSONResponse(internal_error(what, e), status_code=500)
