"""``POST /v1/responses`` (OpenAI's Responses API, as vLLM serves it) on the chat pipeline.

The input items and ``instructions`` become chat messages (after the stored conversation of
``previous_response_id``), the request runs as a chat completion (tools, ``tool_choice``,
``text.format`` through the same constraints), and its answer becomes a response: output
items (a message of ``output_text``, function calls), usage and status. Streamed, the chat
chunks become the Responses event sequence (``response_events.py``). Responses are kept
(``store``, default true, as vLLM) in a bounded in-memory store for ``previous_response_id``
and ``GET /v1/responses/{id}``; the oldest go first.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from compile_runtime.server.access_log import TokenCounts
from compile_runtime.server.api_error import APIError
from compile_runtime.server.chat_completions import chat
from compile_runtime.server.errors import validation_message
from compile_runtime.server.handlers import Server
from compile_runtime.server.protocol import (
    ChatCompletionRequest,
    ResponsesRequest,
    SamplingExtras,
)
from compile_runtime.server.response_events import stream_events
from compile_runtime.server.response_items import ResponseShell, output_items, response_usage


def _text_of(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{index}].content: give a string or a list of text parts",
                       "input")  # fmt: skip
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"input[{index}]: content of type {kind!r} is not supported "
                           "(text parts only)", "input")  # fmt: skip
        texts.append(_string(part, "text", index))
    return "".join(texts)


def _string(item: dict, field: str, index: int) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise APIError(400, f"input[{index}].{field}: give a string (got {value!r:.40})", "input")
    return value


def input_messages(items: str | list[dict]) -> list[dict]:
    """The request's ``input`` as chat messages (function calls as assistant tool calls,
    their outputs as tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{i}].role: {role!r} is not a message role", "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i),
                                 "arguments": _string(item, "arguments", i)}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": output if isinstance(output, str) else _text_of(output, i)})  # fmt: skip
        elif kind != "reasoning":
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported", "input")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported, not "
                           f"{tool.get('type')!r}", "tools")  # fmt: skip
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or "name" not in choice:
            raise APIError(400, "tool_choice: give 'auto', 'none', 'required' or "
                           "{'type': 'function', 'name': ...}", "tool_choice")  # fmt: skip
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format.type: {kind!r} is not one of text, json_object, "
                   "json_schema", "text")  # fmt: skip


def check_request(body: ResponsesRequest) -> None:
    """A 400 naming a field this server cannot honour."""
    if body.background:
        raise APIError(400, "background: background responses are not supported; leave it "
                       "false", "background")  # fmt: skip
    if body.truncation not in (None, "disabled"):
        raise APIError(400, "truncation: only 'disabled' is supported", "truncation")


# The chat fields a /v1/responses request fills under other names.
RESPONSES_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text",
    "stream_options": "stream",
}


def chat_request(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat completion of ``conversation`` under the request's ``instructions`` (those
    of earlier responses are not carried over, as OpenAI has it)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = system + conversation
    if not messages:
        raise APIError(400, "input: give at least one message", "input")
    # vLLM's sampling extras, as the request set them (validated by ResponsesRequest).
    extras = {
        n: getattr(body, n) for n in SamplingExtras.model_fields if n in body.model_fields_set
    }
    # Fields it does not model: a chat field by another name is refused, the rest are judged
    # as chat's unknown fields are (unsupported.py).
    unknown = dict(body.model_extra or {})
    for name in unknown:
        if name in ChatCompletionRequest.model_fields:
            raise APIError(400, f"{name}: not a field of /v1/responses", name)
    fields = dict(
        model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice), response_format=response_format(body.text),
        logprobs=bool(body.top_logprobs), top_logprobs=body.top_logprobs or None,
        stream=body.stream, stream_options={"include_usage": True} if body.stream else None,
    )  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate({**unknown, **extras, **fields})
    except ValidationError as e:
        raise in_responses_terms(APIError(400, *validation_message(list(e.errors())))) from None


def in_responses_terms(error: APIError) -> APIError:
    """``error`` of the chat path naming the field as the /v1/responses client sent it."""
    chat_name = (error.param or "").split(".")[0]
    if chat_name not in RESPONSES_NAMES:
        return error
    param = RESPONSES_NAMES[chat_name]
    return APIError(error.status, error.message.replace(chat_name, param), param)


async def responses(server: Server, body: ResponsesRequest, tokens: TokenCounts) -> Any:
    check_request(body)
    conversation: list[dict] = []
    if body.previous_response_id is not None:
        _, history = server.responses.get(body.previous_response_id, "previous_response_id")
        conversation = list(history)
    conversation += input_messages(body.input)
    request = chat_request(body, conversation)
    shell = ResponseShell(body, body.model or server.model_name)

    def keep(response: dict, message: dict) -> None:
        if body.store is not False:
            server.responses.put(response, conversation + [message])

    try:
        answer = await chat(server, request, tokens)
    except APIError as e:
        raise in_responses_terms(e) from None
    if body.stream:
        return stream_events(answer, shell, keep)
    choice = answer["choices"][0]
    message = {k: v for k, v in choice["message"].items() if k in ("role", "content", "tool_calls")}
    response = shell.make("completed", output_items(message), response_usage(answer.get("usage")),
                          choice["finish_reason"])  # fmt: skip
    keep(response, message)
    return response
