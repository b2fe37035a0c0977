"""Following the choices' requests on the engine: to their end (a whole response) or as
server-sent events, one per sampled token, ending with ``data: [DONE]``. A stop string
ends its request as "stop"; a client that goes away aborts its requests (their KV blocks
freed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from compile_runtime.engine.async_engine import AsyncEngine, ErrorEvent, FinishEvent, TokenEvent
from compile_runtime.server.api_error import APIError, error_body
from compile_runtime.server.choice import Choice

# (choice, text piece, finish reason or None) -> the chunk's body
MakeChunk = Callable[[Choice, str, str | None], dict]

# One encoder for every event of every stream: compact (no spaces) and UTF-8 as it is, as
# vLLM's chunks are: fewer bytes for the server to write and every client to parse.
encode_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


async def updates(engine: AsyncEngine, choice: Choice) -> AsyncIterator[bool]:
    """Follow one choice's request: yields False after each token, True at the end."""
    async for event in engine.events(choice.stream):
        if isinstance(event, TokenEvent):
            choice.add(event)
            if choice.finish_reason == "stop":  # a stop string: the request ends as "stop"
                engine.stop(choice.stream.request.req_id, choice.stop_reason)
                break
            yield False
        elif isinstance(event, FinishEvent):
            choice.finish(event)
        elif isinstance(event, ErrorEvent):
            raise APIError(500, event.message)
    yield True


async def collect(engine: AsyncEngine, choices: list[Choice]) -> None:
    """Every choice to its end, side by side."""

    async def run(choice: Choice) -> None:
        async for _ in updates(engine, choice):
            pass

    tasks = [asyncio.ensure_future(run(c)) for c in choices]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


def event_stream(
    engine: AsyncEngine,
    choices: list[Choice],
    make_chunk: MakeChunk,
    usage: Callable[[list[Choice]], dict] | None,
) -> StreamingResponse:
    """Server-sent events of every choice as its tokens arrive, then ``[DONE]``: one event
    per sampled token, even while its text is held back (a partial character, a possible
    stop string)."""

    def event(choice: Choice, final: bool) -> str | None:
        piece = choice.ready_text(final)
        if piece or final or len(choice.token_ids) > choice.sent_tokens:
            chunk = make_chunk(choice, piece, choice.finish_reason if final else None)
            return f"data: {encode_json(chunk)}\n\n"
        return None

    async def one(choice: Choice) -> AsyncIterator[str]:
        async for final in updates(engine, choice):
            if (text := event(choice, final)) is not None:
                yield text

    async def merged() -> AsyncIterator[str]:  # n > 1: the choices interleaved
        out: asyncio.Queue[str | None] = asyncio.Queue()

        async def run(choice: Choice) -> None:
            async for text in one(choice):
                await out.put(text)

        async def run_all() -> None:
            try:
                await asyncio.gather(*(run(c) for c in choices))
            finally:
                await out.put(None)

        task = asyncio.ensure_future(run_all())
        try:
            while (item := await out.get()) is not None:
                yield item
            await task  # raises what a choice raised
        finally:
            task.cancel()  # the client went away: the choices' streams abort their requests
            with contextlib.suppress(BaseException):
                await task

    async def events() -> AsyncIterator[str]:
        try:
            async for text in one(choices[0]) if len(choices) == 1 else merged():
                yield text
        except APIError as e:
            yield f"data: {encode_json(error_body(e.status, e.message))}\n\n"
        if usage is not None:
            yield f"data: {encode_json(usage(choices))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
