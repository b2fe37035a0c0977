"""The server's work behind the routes: ``Server`` holds the online engine and answers
``/v1/completions`` and ``/v1/chat/completions``. Every request of a call is checked before
any is queued (a bad one is a 400); past ``max_waiting`` queued requests a call is a 503."""

from __future__ import annotations

import time
from typing import Any

from compile_runtime.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from compile_runtime.engine.llm import LLM
from compile_runtime.runner.sampling_params import SamplingParams
from compile_runtime.server import logprobs, openai_format
from compile_runtime.server.access_log import TokenCounts
from compile_runtime.server.choice import Choice
from compile_runtime.server.engine_inputs import (
    DEFAULT_COMPLETION_TOKENS,
    chat_token_ids,
    check_length,
    check_model,
    prompt_token_ids,
    sampling_params,
)
from compile_runtime.server.errors import APIError
from compile_runtime.server.metrics import ServerMetrics
from compile_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from compile_runtime.server.streaming import collect, event_stream
from compile_runtime.server.unsupported import check_fields


class Server:
    def __init__(
        self, llm: LLM, *, model_name: str, model_path: str | None = None, max_waiting: int = 256
    ):
        self.llm = llm
        self.model_name = model_name
        self.model_path = model_path or model_name
        self.max_waiting = max_waiting
        self.engine: AsyncEngine | None = None
        self.metrics: ServerMetrics | None = None
        self.created = int(time.time())

    @property
    def max_model_len(self) -> int:
        return self.llm.runner_config.max_model_len

    def start(self) -> None:
        self.engine = AsyncEngine(self.llm.core, max_waiting=self.max_waiting)
        self.metrics = ServerMetrics(self.engine)

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.llm.shutdown()

    def _submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        fields: tuple[str, str],  # the request's names of the prompt and of max_tokens
        tokens: TokenCounts,
    ) -> list[Choice]:
        """Check every request of the call, then queue them all (or none)."""
        for p in prompts:
            check_length(len(p), params[0].max_tokens, self.max_model_len, *fields)
        engine = self.engine
        requests = [self.llm.make_request(p, sp) for p in prompts for sp in params]
        for r in requests:
            try:
                self.llm.core.check(r)
            except ValueError as e:  # the engine names its request: the user sent no id
                message = str(e).replace(f"request {r.req_id!r}: ", "")
                message = message.replace(f"request {r.req_id!r} ", "the request ")
                param = "logit_bias" if message.startswith("logit_bias") else fields[0]
                raise APIError(400, message, param) from None
        tokens.prompt = sum(len(p) for p in prompts) * len(params)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(tokens.prompt)
        choices = []
        try:
            for i, r in enumerate(requests):
                sp = r.sampling_params
                choice = Choice(self.llm.tokenizer, sp.stop, sp.include_stop_str_in_output,
                                sp.skip_special_tokens, index=i, stream=engine.submit(r))  # fmt: skip
                choices.append(choice)
        except (EngineOverloadedError, EngineDeadError) as e:
            for c in choices:
                engine.abort(c.stream.request.req_id)
            raise APIError(503, str(e)) from None
        tokens.choices = choices
        return choices

    async def completions(self, body: CompletionRequest, tokens: TokenCounts) -> Any:
        check_model(body.model, self.model_name)
        check_fields(body)
        if body.echo and body.stream:
            raise APIError(400, "echo: not supported with stream=true; drop one", "echo")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(
                400, "prompt_logprobs: not supported with stream=true", "prompt_logprobs"
            )
        tok = self.llm.tokenizer
        add_special = body.add_special_tokens is not False
        prompts = prompt_token_ids(body.prompt, tok, add_special)
        k = body.logprobs
        scored = [n for n in (k if body.echo else None, body.prompt_logprobs) if n is not None]
        max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params(
            body, max_tokens, "max_tokens", k, "logprobs", max(scored) if scored else None
        )
        choices = self._submit(prompts, params, ("prompt", "max_tokens"), tokens)
        envelope = openai_format.envelope("cmpl", self.model_name)

        def payload(choices_json: list[dict], usage: dict | None = None) -> dict:
            return envelope("text_completion", choices_json, usage)

        if body.stream:
            every = body.stream_options is not None and body.stream_options.continuous_usage_stats

            def chunk(choice: Choice, piece: str, finish: str | None) -> dict:
                json = openai_format.completion_chunk_choice(choice, piece, finish, tok, k)
                return payload([json], openai_format.usage(prompts, choices) if every else None)

            def usage(cs: list[Choice]) -> dict:
                return payload([], openai_format.usage(prompts, cs))

            return event_stream(self.engine, choices, chunk, usage if body.want_usage else None)
        await collect(self.engine, choices)

        def one(c: Choice) -> dict:
            prompt = prompts[c.index // body.num_choices]
            text, ids, entries = c.text, c.token_ids, c.logprobs
            if body.echo:
                text = (
                    openai_format.prompt_text(
                        body.prompt, prompts, c.index // body.num_choices, tok
                    )
                    + text
                )
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

    async def chat(self, body: ChatCompletionRequest, tokens: TokenCounts) -> Any:
        check_model(body.model, self.model_name)
        check_fields(body)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(
                400, "prompt_logprobs: not supported with stream=true", "prompt_logprobs"
            )
        tok = self.llm.tokenizer
        ids = chat_token_ids(
            body.messages,
            tok,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
            add_special_tokens=body.add_special_tokens,
        )
        max_field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = (
            body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        )
        if max_tokens is None:  # what is left of max_model_len, as vLLM answers
            check_length(len(ids), 1, self.max_model_len, "messages", max_field)
            max_tokens = self.max_model_len - len(ids)
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(
            body, max_tokens, max_field, k, "top_logprobs", body.prompt_logprobs
        )
        choices = self._submit([ids], params, ("messages", max_field), tokens)
        payload = openai_format.envelope("chatcmpl", self.model_name)

        if body.stream:
            every = body.stream_options is not None and body.stream_options.continuous_usage_stats
            started: set[int] = set()

            def chunk(choice: Choice, piece: str, finish: str | None) -> dict:
                first = choice.index not in started
                started.add(choice.index)
                json = openai_format.chat_chunk_choice(choice, piece, finish, first, tok, k)
                usage = openai_format.usage([ids], choices) if every else None
                return payload("chat.completion.chunk", [json], usage)

            def usage(cs: list[Choice]) -> dict:
                return payload("chat.completion.chunk", [], openai_format.usage([ids], cs))

            return event_stream(self.engine, choices, chunk, usage if body.want_usage else None)
        await collect(self.engine, choices)
        extra = {}
        if body.prompt_logprobs is not None:
            extra["prompt_logprobs"] = logprobs.prompt_logprobs(
                ids, choices[0].stream.prompt_logprobs, tok, body.prompt_logprobs
            )
        return payload(
            "chat.completion",
            [openai_format.chat_choice(c, tok, k) for c in choices],
            openai_format.usage([ids], choices),
            **extra,
        )
