"""The Responses API's objects: a response (``ResponseShell``: what it says of its request,
around its output), its output items (a message of ``output_text``, a function call) and
its usage, built from a chat completion's answer."""

from __future__ import annotations

import time
import uuid

from compile_runtime.server.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg"), "type": "message", "status": status,
            "role": "assistant", "content": [output_text(text)] if text is not None else []}  # fmt: skip


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    fn = call.get("function", {})
    return {"id": item_id or new_id("fc"), "type": "function_call", "status": status,
            "call_id": call.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments", "")}  # fmt: skip


def output_items(message: dict) -> list[dict]:
    """A chat message as response output items: its text, then its tool calls."""
    items = []
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(message.get("content") or ""))
    items += [function_call_item(call) for call in message.get("tool_calls") or []]
    return items


def response_usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}  # fmt: skip


class ResponseShell:
    """What a response says of its request (the same in every event of a stream)."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.id, self.created = new_id("resp"), int(time.time())
        self.body = body
        self.model = model

    def make(self, status: str, output: list[dict], usage: dict | None = None,
             finish_reason: str | None = None) -> dict:  # fmt: skip
        b = self.body
        incomplete = finish_reason == "length"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature, "top_p": b.top_p, "tools": b.tools or [],
            "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "text": b.text or {"format": {"type": "text"}},
            "previous_response_id": b.previous_response_id, "store": b.store is not False,
            "metadata": b.metadata or {}, "truncation": "disabled", "reasoning": None,
            "user": b.user, "background": False, "output": output, "usage": usage,
        }  # fmt: skip
