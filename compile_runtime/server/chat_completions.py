"""``POST /v1/chat/completions``: messages through the model's chat template, ``n`` choices,
whole or streamed, with logprobs, structured outputs and tool calls: forced (``tools.py``:
the output constrained to the tools' schemas) or ``auto`` (parsed out of free text,
``tool_parsers.py``), answered as ``tool_calls``; in a stream, as deltas: each call's name,
then its arguments as they are generated (``tool_call_text.py``)."""

from __future__ import annotations

import json
from typing import Any

from compile_runtime.server import logprobs, openai_format
from compile_runtime.server.access_log import TokenCounts
from compile_runtime.server.api_error import APIError
from compile_runtime.server.choice import Choice
from compile_runtime.server.engine_inputs import (
    chat_token_ids,
    check_length,
    constraint_field,
    output_constraint,
    sampling_params,
)
from compile_runtime.server.handlers import Server
from compile_runtime.server.protocol import ChatCompletionRequest
from compile_runtime.server.streaming import collect, event_stream
from compile_runtime.server.structured import ConstraintError
from compile_runtime.server.tool_call_text import CallDeltas
from compile_runtime.server.tools import AUTO, constrained_calls, tool_calls, tool_constraint
from compile_runtime.server.unsupported import check_fields


def _tool_call_constraint(server: Server, body: ChatCompletionRequest):
    """(the constraint of a forced tool call or None, the forced function's name, AUTO for
    calls parsed out of free text, or None)."""
    # No tool_choice with tools is "auto", as OpenAI and vLLM take it.
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else None)
    try:
        return tool_constraint(body.tools, choice, server.tool_parser is not None)
    except ConstraintError as e:
        raise APIError(400, str(e), e.param) from None


def _message(
    server: Server, choice: Choice, calls: bool, forced: str | None
) -> tuple[dict, str | None]:
    """The assistant's message and the finish reason: its text, or its tool calls when they
    were asked for and the output is complete (finish "tool_calls" for "required" and for
    parsed calls, "stop" for a named function, as vLLM answers)."""
    if forced == AUTO:
        content, made = server.tool_parser.parse(choice.text)
        if not made:
            return {"role": "assistant", "content": choice.text}, choice.finish_reason
        finish = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        return {"role": "assistant", "content": content, "tool_calls": made}, finish
    if calls:
        try:
            made = tool_calls(choice.text, forced)
        except (json.JSONDecodeError, KeyError, TypeError):  # cut short (max_tokens)
            made = None
        if made:
            finish = "tool_calls" if forced is None and choice.finish_reason == "stop" else None
            message = {"role": "assistant", "content": None, "tool_calls": made}
            return message, finish or choice.finish_reason
    return {"role": "assistant", "content": choice.text}, choice.finish_reason


async def chat(server: Server, body: ChatCompletionRequest, tokens: TokenCounts) -> Any:
    lora_request = server.adapters.resolve(body.model)
    check_fields(body)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
    tool_call, forced = _tool_call_constraint(server, body)
    constraint = await server.pool.run(
        output_constraint, body, what="checking the output constraint",
        param=constraint_field(body),
    )  # fmt: skip
    if tool_call is not None and constraint is not None:
        message = "tool_choice: a forced tool call constrains the output already; drop the other"
        raise APIError(400, message, "tool_choice")
    calls = tool_call is not None
    await server.compile_constraint(
        tool_call or constraint, "tool_choice" if calls else constraint_field(body)
    )
    tok = server.llm.tokenizer
    ids = await server.pool.run(
        chat_token_ids, body, tok, body.tools, server.max_model_len,
        server.trust_request_chat_template, what="rendering the chat template",
        param="messages", interrupt=True,
    )  # fmt: skip
    max_field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = (
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    )
    if max_tokens is None:  # what is left of max_model_len, as vLLM answers
        check_length(len(ids), 1, server.max_model_len, "messages", max_field)
        max_tokens = server.max_model_len - len(ids)
    k = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(
        body, max_tokens, max_field, k, "top_logprobs", body.prompt_logprobs,
        tool_call or constraint,
    )  # fmt: skip
    choices = await server.submit([ids], params, ("messages", max_field), tokens, lora_request)
    payload = openai_format.envelope("chatcmpl", body.model or server.model_name)

    if body.stream:
        every = body.stream_options is not None and body.stream_options.continuous_usage_stats
        started: set[int] = set()
        released: dict[int, str] = {}  # tool calls: the text released per choice
        sent: dict[int, int] = {}  # auto: how much of it went out as content
        deltas: dict[int, CallDeltas] = {}

        def content_piece(choice: Choice, text: str, piece: str, finish: str | None) -> str:
            if calls:
                return ""
            if forced != AUTO:
                return piece
            done = sent.get(choice.index, 0)
            if finish is not None:  # what is left of the content, calls taken out
                content = _message(server, choice, calls, forced)[0]["content"] or ""
                sent[choice.index] = len(content)
                return content[done:]
            sent[choice.index] = upto = max(done, server.tool_parser.streamable(text))
            return text[done:upto]

        def chunk(choice: Choice, piece: str, finish: str | None) -> dict:
            first = choice.index not in started
            started.add(choice.index)
            text = released[choice.index] = released.get(choice.index, "") + piece
            out = openai_format.chat_chunk_choice(
                choice, content_piece(choice, text, piece, finish), finish, first, tok, k
            )
            if calls or forced == AUTO:  # each call's name, then its arguments as they come
                found = (
                    server.tool_parser.stream_calls(text)
                    if forced == AUTO
                    else constrained_calls(text, forced)
                )
                made = deltas.setdefault(choice.index, CallDeltas()).update(found)
                if made:
                    out["delta"]["tool_calls"] = made
                    if not out["delta"].get("content"):
                        out["delta"].pop("content", None)
                if finish is not None:
                    message, out["finish_reason"] = _message(server, choice, calls, forced)
                    if calls and not message.get("tool_calls"):  # cut short: the text
                        out["delta"]["content"] = message["content"]
            usage = openai_format.usage([ids], choices) if every else None
            return payload("chat.completion.chunk", [out], usage)

        def usage(cs: list[Choice]) -> dict:
            return payload("chat.completion.chunk", [], openai_format.usage([ids], cs))

        return event_stream(server.engine, choices, chunk, usage if body.want_usage else None)
    await collect(server.engine, choices)
    extra = {}
    if body.prompt_logprobs is not None:
        extra["prompt_logprobs"] = logprobs.prompt_logprobs(
            ids, choices[0].stream.prompt_logprobs, tok, body.prompt_logprobs
        )
    return payload(
        "chat.completion",
        [
            openai_format.chat_choice(c, tok, k, *_message(server, c, calls, forced))
            for c in choices
        ],
        openai_format.usage([ids], choices),
        **extra,
    )
