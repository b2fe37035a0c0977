"""A streamed chat completion as the Responses API's server-sent events.

The order the OpenAI SDK's stream helper expects: ``response.created``,
``response.in_progress``; for the text, ``response.output_item.added`` (a message),
``response.content_part.added``, one ``response.output_text.delta`` per chat delta, then
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; for each tool call, ``response.output_item.added`` (a
function call), ``response.function_call_arguments.delta`` per argument fragment,
``response.function_call_arguments.done``, ``response.output_item.done``; last
``response.completed`` with the whole response (status "incomplete" when it was cut at
``max_output_tokens``, as vLLM sends it). Every event
carries a ``sequence_number``; an error is an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from compile_runtime.server.response_items import (
    ResponseShell,
    function_call_item,
    message_item,
    output_text,
    response_usage,
)
from compile_runtime.server.streaming import encode_json


class EventWriter:
    """Numbers and formats the events of one stream, and builds its output items."""

    def __init__(self, shell: ResponseShell):
        self.shell = shell
        self.sequence = 0
        self.items: list[dict] = []  # output items, as they stand
        self.text_item: int | None = None  # the open message item's index
        self.calls: dict[int, int] = {}  # chat tool-call index -> output item index

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {encode_json(data)}\n\n"

    def text(self, piece: str) -> list[str]:
        out = []
        if self.text_item is None:
            self.text_item = len(self.items)
            item = message_item(None, "in_progress")
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=self.text_item,
                                  item=item))  # fmt: skip
            item["content"] = [output_text("")]
            out.append(
                self.event("response.content_part.added", **self._part(), part=output_text(""))
            )
        self.items[self.text_item]["content"][0]["text"] += piece
        if piece:
            out.append(self.event("response.output_text.delta", **self._part(), delta=piece,
                                  logprobs=[]))  # fmt: skip
        return out

    def _part(self) -> dict:
        item = self.items[self.text_item]
        return {"item_id": item["id"], "output_index": self.text_item, "content_index": 0}

    def close_text(self) -> list[str]:
        if self.text_item is None:
            return []
        item, index = self.items[self.text_item], self.text_item
        part = item["content"][0]
        item["status"] = "completed"
        out = [
            self.event("response.output_text.done", **self._part(), text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **self._part(), part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.text_item = None
        return out

    def tool_call(self, delta: dict) -> list[str]:
        out = []
        index = self.calls.get(delta.get("index", 0))
        fn = delta.get("function") or {}
        if index is None:
            out += self.close_text()
            index = self.calls[delta.get("index", 0)] = len(self.items)
            call = {"id": delta.get("id"), "function": {"name": fn.get("name"), "arguments": ""}}
            item = function_call_item(call, "in_progress")
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=index, item=item))
        item = self.items[index]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=index, delta=fn["arguments"]))  # fmt: skip
        return out

    def close(self) -> list[str]:
        out = self.close_text()
        for index in self.calls.values():
            item = self.items[index]
            item["status"] = "completed"
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"],
                                  arguments=item["arguments"]))  # fmt: skip
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.calls = {}
        return out


def stream_events(
    chat_stream: StreamingResponse,
    shell: ResponseShell,
    keep: Callable[[dict, dict], None],
) -> StreamingResponse:
    """The Responses events of ``chat_stream`` (one choice); ``keep(response, message)``
    stores the finished response with its assistant message."""

    async def events() -> AsyncIterator[str]:
        w = EventWriter(shell)
        yield w.event("response.created", response=shell.make("in_progress", []))
        yield w.event("response.in_progress", response=shell.make("in_progress", []))
        finish, usage = None, None
        async for raw in chat_stream.body_iterator:
            line = raw if isinstance(raw, str) else raw.decode()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                yield w.event("error", code=str(error.get("code")), message=error["message"],
                              param=error.get("param"))  # fmt: skip
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    for text in w.text(delta["content"]):
                        yield text
                for call in delta.get("tool_calls") or []:
                    for text in w.tool_call(call):
                        yield text
                finish = choice.get("finish_reason") or finish
        for text in w.close():
            yield text
        response = shell.make("completed", w.items, response_usage(usage), finish)
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in w.items if i["type"] == "function_call"]  # fmt: skip
        texts = [i["content"][0]["text"] for i in w.items if i["type"] == "message"]
        message = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        keep(response, message)
        yield w.event("response.completed", response=response)  # status may be "incomplete"

    return StreamingResponse(events(), media_type="text/event-stream")
