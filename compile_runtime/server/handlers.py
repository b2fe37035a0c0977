"""The server's work behind the routes: ``Server`` holds the online engine and answers
``/v1/completions`` and ``/v1/chat/completions``. Every request of a call is checked before
any is queued (a bad one is a 400); past ``max_waiting`` queued requests a call is a 503."""

from __future__ import annotations

import time
from typing import Any

from compile_runtime.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from compile_runtime.engine.llm import LLM
from compile_runtime.runner.sampling_params import SamplingParams
from compile_runtime.server import openai_format
from compile_runtime.server.choice import Choice
from compile_runtime.server.engine_inputs import (
    DEFAULT_COMPLETION_TOKENS,
    chat_token_ids,
    prompt_token_ids,
    sampling_params,
)
from compile_runtime.server.errors import APIError
from compile_runtime.server.metrics import ServerMetrics
from compile_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from compile_runtime.server.streaming import collect, event_stream


class Server:
    def __init__(self, llm: LLM, *, model_name: str, max_waiting: int = 256):
        self.llm = llm
        self.model_name = model_name
        self.max_waiting = max_waiting
        self.engine: AsyncEngine | None = None
        self.metrics: ServerMetrics | None = None
        self.created = int(time.time())

    def start(self) -> None:
        self.engine = AsyncEngine(self.llm.core, max_waiting=self.max_waiting)
        self.metrics = ServerMetrics(self.engine)

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.llm.shutdown()

    def _submit(self, prompts: list[list[int]], params: list[SamplingParams], stop: list[str]):
        """Check every request of the call, then queue them all (or none)."""
        engine = self.engine
        requests = [self.llm.make_request(p, sp) for p in prompts for sp in params]
        for r in requests:
            try:
                self.llm.core.check(r)
            except ValueError as e:
                raise APIError(400, str(e), "prompt") from None
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts) * len(params))
        choices = []
        try:
            for i, r in enumerate(requests):
                choices.append(Choice(self.llm.tokenizer, stop, index=i, stream=engine.submit(r)))
        except (EngineOverloadedError, EngineDeadError) as e:
            for c in choices:
                engine.abort(c.stream.request.req_id)
            raise APIError(503, str(e)) from None
        return choices

    async def completions(self, body: CompletionRequest) -> Any:
        if body.echo and body.stream:
            raise APIError(400, "echo is not supported with stream=true; drop one", "echo")
        tok = self.llm.tokenizer
        prompts = prompt_token_ids(body.prompt, tok)
        params = sampling_params(
            body,
            self.model_name,
            body.max_tokens or DEFAULT_COMPLETION_TOKENS,
            body.logprobs,
            prompt_logprobs=body.logprobs if body.echo else None,
        )
        choices = self._submit(prompts, params, body.stop_strings())
        envelope = openai_format.envelope("cmpl", self.model_name)

        def payload(choices_json: list[dict], usage: dict | None = None) -> dict:
            return envelope("text_completion", choices_json, usage)

        if body.stream:
            want_usage = body.stream_options is not None and body.stream_options.include_usage

            def chunk(choice: Choice, piece: str, finish: str | None) -> dict:
                return payload([openai_format.completion_chunk_choice(choice, piece, finish)])

            usage = (
                (lambda cs: payload([], openai_format.usage(prompts, cs))) if want_usage else None
            )
            return event_stream(self.engine, choices, chunk, usage)
        await collect(self.engine, choices)

        def text(c: Choice) -> str:
            if not body.echo:
                return c.text
            return openai_format.prompt_text(body.prompt, prompts, c.index // body.n, tok) + c.text

        return payload(
            [
                openai_format.completion_choice(
                    c, text(c), openai_format.completion_logprobs(c, tok, body.echo)
                )
                for c in choices
            ],
            openai_format.usage(prompts, choices),
        )

    async def chat(self, body: ChatCompletionRequest) -> Any:
        ids = chat_token_ids(body.messages, self.llm.tokenizer)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = self.llm.runner_config.max_model_len - len(ids)
            if max_tokens < 1:
                raise APIError(400, "the messages fill max_model_len", "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, self.model_name, max_tokens, logprobs)
        choices = self._submit([ids], params, body.stop_strings())
        payload = openai_format.envelope("chatcmpl", self.model_name)

        if body.stream:
            want_usage = body.stream_options is not None and body.stream_options.include_usage
            started: set[int] = set()

            def chunk(choice: Choice, piece: str, finish: str | None) -> dict:
                first = choice.index not in started
                started.add(choice.index)
                return payload(
                    "chat.completion.chunk",
                    [openai_format.chat_chunk_choice(choice, piece, finish, first)],
                )

            usage = (
                (lambda cs: payload("chat.completion.chunk", [], openai_format.usage([ids], cs)))
                if want_usage
                else None
            )
            return event_stream(self.engine, choices, chunk, usage)
        await collect(self.engine, choices)
        return payload(
            "chat.completion",
            [openai_format.chat_choice(c) for c in choices],
            openai_format.usage([ids], choices),
        )
