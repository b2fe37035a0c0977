"""Request bodies decoded and validated as FastAPI does (``json.loads``, then the pydantic
model, its errors a ``RequestValidationError`` the app answers as a 400 naming the field),
but a large body (``OFF_LOOP_BYTES`` or more) off the event loop: in a thread, one at a
time. Decoding a 2 MB body and checking it (its text, a schema, a choice list) holds the
GIL for milliseconds at a time; on the loop, a stream of such bodies would keep ``/health``
and every other request waiting behind them, and several threads at once would each take
their turn before the loop gets the GIL back.

A route takes its body as ``body: Annotated[Model, Depends(body_of(Model))]``.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

OFF_LOOP_BYTES = 64 << 10
# Per event loop (tests run apps in several): the one large body being decoded.
_one_at_a_time: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def parse(model: type[M], raw: bytes) -> M:
    """``model`` from the body's bytes, or the ``RequestValidationError`` FastAPI raises."""
    if not raw:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
              "input": {}, "ctx": {"error": e.msg}}]
        ) from None  # fmt: skip
    except (UnicodeDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else "not UTF-8"
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
              "input": {}, "ctx": {"error": reason}}]
        ) from None  # fmt: skip
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in e.errors()]
        raise RequestValidationError(errors) from None


def body_of(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency: the request's body as ``model``."""

    async def body(request: Request) -> M:
        raw = await request.body()
        if len(raw) < OFF_LOOP_BYTES:
            return parse(model, raw)
        loop = asyncio.get_running_loop()
        if loop not in _one_at_a_time:
            _one_at_a_time[loop] = asyncio.Semaphore(1)
        async with _one_at_a_time[loop]:
            return await asyncio.to_thread(parse, model, raw)

    return body
