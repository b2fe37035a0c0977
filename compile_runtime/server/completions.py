"""``POST /v1/completions``: prompts (text or token ids, one or several), ``n`` choices each,
whole or streamed; ``echo`` prepends the prompt (with ``logprobs``, scored token by token,
as evaluation harnesses use it), ``prompt_logprobs`` as vLLM returns them."""

from __future__ import annotations

from typing import Any

from compile_runtime.server import logprobs, openai_format
from compile_runtime.server.access_log import TokenCounts
from compile_runtime.server.api_error import APIError
from compile_runtime.server.choice import Choice
from compile_runtime.server.engine_inputs import (
    DEFAULT_COMPLETION_TOKENS,
    constraint_field,
    output_constraint,
    prompt_token_ids,
    sampling_params,
)
from compile_runtime.server.handlers import Server
from compile_runtime.server.protocol import CompletionRequest
from compile_runtime.server.streaming import collect, event_stream
from compile_runtime.server.unsupported import check_fields


async def completions(server: Server, body: CompletionRequest, tokens: TokenCounts) -> Any:
    lora_request = server.adapters.resolve(body.model)
    check_fields(body)
    if body.echo and body.stream:
        raise APIError(400, "echo is not supported with stream=true; drop one", "echo")
    tok = server.llm.tokenizer
    prompts = await server.pool.run(
        prompt_token_ids, body.prompt, tok, body.add_special_tokens, server.max_model_len,
        what="tokenizing the prompt", param="prompt",
    )  # fmt: skip
    k = body.logprobs
    scored = [n for n in (k if body.echo else None, body.prompt_logprobs) if n is not None]
    max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
    constraint = await server.pool.run(
        output_constraint, body, what="checking the output constraint",
        param=constraint_field(body),
    )  # fmt: skip
    await server.compile_constraint(constraint, constraint_field(body))
    params = sampling_params(
        body, max_tokens, "max_tokens", k, "logprobs", max(scored, default=None), constraint
    )
    choices = await server.submit(prompts, params, ("prompt", "max_tokens"), tokens, lora_request)
    envelope = openai_format.envelope("cmpl", body.model or server.model_name)

    def payload(choices_json: list[dict], usage: dict | None = None) -> dict:
        return envelope("text_completion", choices_json, usage)

    if body.stream:
        every = body.stream_options is not None and body.stream_options.continuous_usage_stats

        def chunk(choice: Choice, piece: str, finish: str | None) -> dict:
            json = openai_format.completion_chunk_choice(choice, piece, finish, tok, k)
            return payload([json], openai_format.usage(prompts, choices) if every else None)

        def usage(cs: list[Choice]) -> dict:
            return payload([], openai_format.usage(prompts, cs))

        return event_stream(server.engine, choices, chunk, usage if body.want_usage else None)
    await collect(server.engine, choices)

    def one(c: Choice) -> dict:
        which = c.index // body.num_choices
        prompt = prompts[which]
        text, ids, entries = c.text, c.token_ids, c.logprobs
        if body.echo:
            text = openai_format.prompt_text(body.prompt, prompts, which, tok) + text
            ids = prompt + ids
            entries = (c.stream.prompt_logprobs or [None] * len(prompt)) + entries
        lps = None if k is None else logprobs.completion_logprobs(ids, entries, tok, k)[0]
        extra = {}
        if body.prompt_logprobs is not None:
            extra["prompt_logprobs"] = logprobs.prompt_logprobs(
                prompt, c.stream.prompt_logprobs, tok, body.prompt_logprobs
            )
        return openai_format.completion_choice(c, text, lps, **extra)

    return payload([one(c) for c in choices], openai_format.usage(prompts, choices))
