"""``compile-runtime serve``: the OpenAI HTTP API over one online engine.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events
ending with ``data: [DONE]``, or whole), ``/v1/models``, ``/health`` and
``/metrics`` (Prometheus). Every request is checked before it is queued; a bad
one is a 400 with an OpenAI-style error body, never a 500, and the server goes
on. Past ``max_waiting`` queued requests a new one is a 503. A streaming client
that goes away aborts its request (its KV blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from compile_runtime.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    ErrorEvent,
    FinishEvent,
    RequestStream,
    TokenEvent,
)
from compile_runtime.engine.llm import LLM
from compile_runtime.runner.sampling_params import SamplingParams
from compile_runtime.server.metrics import ServerMetrics
from compile_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}.get(
        status, "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# ---- text of one choice: incremental detokenization and stop strings ---------------------


@dataclass
class Choice:
    index: int
    stream: RequestStream
    stop: list[str]
    tokenizer: Any
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text: str = ""  # decoded so far, cut at a stop string
    sent: int = 0  # characters of text already streamed
    sent_tokens: int = 0  # token ids already streamed
    finish_reason: str | None = None
    # Incremental detokenizing: token_ids[prefix:read] were decoded last time, as context
    # for the next ones (a token's text can depend on the token before it).
    prefix: int = 0
    read: int = 0

    def add(self, event: TokenEvent) -> None:
        self.token_ids.append(event.token)
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
        self._text_until_stop(final=False)

    def flush(self) -> None:
        """At the request's end: the text still held back (partial characters too)."""
        self._text_until_stop(final=True)

    def _text_until_stop(self, final: bool) -> None:
        if self.tokenizer is None:
            return
        self.decode_new_tokens(final)
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.text = self.text[:at]
                self.finish_reason = "stop"

    def decode_new_tokens(self, final: bool = False) -> None:
        """Append the text of the tokens since the last call: decode a short window (the
        previous tokens for context, then the new ones), not the whole output each time.
        Unless ``final``, a window ending in part of a character waits for more tokens."""
        if self.tokenizer is None or self.read == len(self.token_ids):
            return
        decode = self.tokenizer.decode
        before = decode(self.token_ids[self.prefix : self.read], skip_special_tokens=True)
        window = decode(self.token_ids[self.prefix :], skip_special_tokens=True)
        if window.endswith("\ufffd") and not final:
            return
        if window.startswith(before):
            self.text += window[len(before) :]
        else:  # the new tokens changed the context's text: decode everything, once
            self.text = decode(self.token_ids, skip_special_tokens=True)
        self.prefix, self.read = self.read, len(self.token_ids)

    def ready_text(self, final: bool) -> str:
        """Text not streamed yet, holding back what may still become a stop string or is a
        partial character."""
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1
            hold = max((len(s) - 1 for s in self.stop), default=0)
            end = max(self.sent, end - hold)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece

    def new_token_ids(self) -> list[int]:
        ids = self.token_ids[self.sent_tokens :]
        self.sent_tokens = len(self.token_ids)
        return ids


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

    # ---- requests ---------------------------------------------------------------------

    def _params(
        self,
        body: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ):
        if body.model != self.model_name:
            raise APIError(
                400, f"model {body.model!r} is not served here; use {self.model_name!r}", "model"
            )
        bias: dict[int, float] = {}
        for key, value in (body.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(
                    400, f"logit_bias key {key!r} is not a token id", "logit_bias"
                ) from None
        try:
            return [
                SamplingParams(
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=body.top_k,
                    max_tokens=max_tokens,
                    seed=None if body.seed is None else body.seed + i,
                    frequency_penalty=body.frequency_penalty,
                    presence_penalty=body.presence_penalty,
                    repetition_penalty=body.repetition_penalty,
                    min_tokens=body.min_tokens,
                    logit_bias=bias,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    ignore_eos=body.ignore_eos,
                )
                for i in range(body.n)
            ]
        except ValidationError as e:
            raise APIError(400, str(e).splitlines()[-1].strip()) from None

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
                choices.append(Choice(i, engine.submit(r), stop, self.llm.tokenizer))
        except (EngineOverloadedError, EngineDeadError) as e:
            for c in choices:
                engine.abort(c.stream.request.req_id)
            raise APIError(503, str(e)) from None
        return choices

    async def _updates(self, choice: Choice) -> AsyncIterator[bool]:
        """Follow one choice's request: yields False after each token, True at the end."""
        async for event in self.engine.events(choice.stream):
            if isinstance(event, TokenEvent):
                choice.add(event)
                if choice.finish_reason == "stop":  # a stop string: this request is done
                    self.engine.abort(choice.stream.request.req_id)
                    break
                yield False
            elif isinstance(event, FinishEvent):
                choice.flush()
                if choice.finish_reason != "stop":
                    choice.finish_reason = {"length": "length", "abort": "abort"}.get(
                        event.reason, "stop"
                    )
            elif isinstance(event, ErrorEvent):
                raise APIError(500, event.message)
        yield True

    async def _collect(self, choices: list[Choice]) -> None:
        async def run(choice: Choice) -> None:
            async for _ in self._updates(choice):
                pass

        tasks = [asyncio.ensure_future(run(c)) for c in choices]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    def _stream(self, choices: list[Choice], make_chunk, usage: dict | None) -> AsyncIterator[str]:
        """Server-sent events of every choice as its tokens arrive, then ``[DONE]``: one event
        per sampled token, even while its text is held back (a partial character, a possible
        stop string)."""

        def event(choice: Choice, final: bool) -> str | None:
            piece = choice.ready_text(final)
            if piece or final or len(choice.token_ids) > choice.sent_tokens:
                chunk = make_chunk(choice, piece, choice.finish_reason if final else None)
                return f"data: {json.dumps(chunk)}\n\n"
            return None

        async def one(choice: Choice) -> AsyncIterator[str]:
            async for final in self._updates(choice):
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
                yield f"data: {json.dumps(error_body(e.status, e.message))}\n\n"
            if usage is not None:
                yield f"data: {json.dumps(usage(choices))}\n\n"
            yield "data: [DONE]\n\n"

        return events()

    def _envelope(self, prefix: str):
        """``make(object, choices, usage=None)``: a response body with this call's id."""
        rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

        def make(obj: str, choices_json: list[dict], usage: dict | None = None) -> dict:
            out = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": choices_json,
            }
            if usage is not None:
                out["usage"] = usage
            return out

        return make

    @staticmethod
    def _usage(prompts: list[list[int]], choices: list[Choice]) -> dict[str, int]:
        prompt = sum(len(p) for p in prompts)
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _completion_logprobs(self, choice: Choice, echo: bool = False) -> dict[str, Any] | None:
        """OpenAI's logprobs object; with ``echo`` the prompt's tokens come first (the first
        without a logprob: nothing precedes it)."""
        if not choice.logprobs:
            return None
        tok = self.llm.tokenizer

        def text(t: int) -> str:
            return tok.decode([t]) if tok is not None else str(t)

        token_ids, entries = list(choice.token_ids), list(choice.logprobs)
        if echo:
            token_ids = choice.stream.request.prompt_token_ids + token_ids
            entries = (choice.stream.prompt_logprobs or []) + entries
        return {
            "tokens": [text(t) for t in token_ids],
            "token_logprobs": [None if lp is None else lp[0] for lp in entries],
            "top_logprobs": [
                None if lp is None else {text(t): v for t, v in lp[1]} for lp in entries
            ],
            "text_offset": [],
        }

    def _prompt_text(self, prompt: Any, prompts: list[list[int]], index: int) -> str:
        """Prompt ``index`` as the client sent it (text), or its ids decoded (``echo``)."""
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[index], str):
            return prompt[index]
        tok = self.llm.tokenizer
        ids = prompts[index]
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else ""

    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.llm.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
                out.append(self.llm.tokenizer(p)["input_ids"])
            else:
                out.append(list(p))
        return out

    async def completions(self, body: CompletionRequest) -> Any:
        if body.echo and body.stream:
            raise APIError(400, "echo is not supported with stream=true; drop one", "echo")
        prompts = self._prompts(body.prompt)
        params = self._params(
            body,
            body.max_tokens or DEFAULT_COMPLETION_TOKENS,
            body.logprobs,
            prompt_logprobs=body.logprobs if body.echo else None,
        )
        choices = self._submit(prompts, params, body.stop_strings())
        envelope = self._envelope("cmpl")

        def payload(choices_json: list[dict], usage: dict | None = None) -> dict:
            return envelope("text_completion", choices_json, usage)

        if body.stream:
            want_usage = body.stream_options is not None and body.stream_options.include_usage

            def chunk(choice: Choice, piece: str, finish: str | None) -> dict:
                return payload(
                    [{"index": choice.index, "text": piece, "logprobs": None,
                      "finish_reason": finish, "token_ids": choice.new_token_ids()}]
                )  # fmt: skip

            usage = (lambda cs: payload([], self._usage(prompts, cs))) if want_usage else None
            return StreamingResponse(
                self._stream(choices, chunk, usage), media_type="text/event-stream"
            )
        await self._collect(choices)
        return payload(
            [
                {
                    "index": c.index,
                    "text": self._prompt_text(body.prompt, prompts, c.index // body.n) + c.text
                    if body.echo
                    else c.text,
                    "logprobs": self._completion_logprobs(c, body.echo),
                    "finish_reason": c.finish_reason,
                    "token_ids": c.token_ids,
                }
                for c in choices
            ],
            self._usage(prompts, choices),
        )

    async def chat(self, body: ChatCompletionRequest) -> Any:
        tok = self.llm.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(
                400,
                "this model has no chat template (tokenizer_config.json chat_template); "
                "use /v1/completions",
                "messages",
            )
        messages = [
            {
                "role": m.role,
                "content": m.content
                if isinstance(m.content, str)
                else "".join(p.get("text", "") for p in m.content),
            }
            for m in body.messages
        ]
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise APIError(400, f"the chat template failed: {e}", "messages") from None
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = self.llm.runner_config.max_model_len - len(ids)
            if max_tokens < 1:
                raise APIError(400, "the messages fill max_model_len", "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, max_tokens, logprobs)
        choices = self._submit([list(ids)], params, body.stop_strings())
        payload = self._envelope("chatcmpl")

        if body.stream:
            want_usage = body.stream_options is not None and body.stream_options.include_usage
            started: set[int] = set()

            def chunk(choice: Choice, piece: str, finish: str | None) -> dict:
                choice.new_token_ids()
                delta: dict[str, Any] = {"content": piece}
                if choice.index not in started:
                    started.add(choice.index)
                    delta["role"] = "assistant"
                return payload(
                    "chat.completion.chunk",
                    [{"index": choice.index, "delta": delta, "finish_reason": finish}],
                )

            usage = (
                (lambda cs: payload("chat.completion.chunk", [], self._usage([ids], cs)))
                if want_usage
                else None
            )
            return StreamingResponse(
                self._stream(choices, chunk, usage), media_type="text/event-stream"
            )
        await self._collect(choices)
        return payload(
            "chat.completion",
            [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                }
                for c in choices
            ],
            self._usage([ids], choices),
        )


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop)  # running requests finish first

    app = FastAPI(title="compile_runtime", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(e)
        return JSONResponse(error_body(400, message, where or None), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"{type(e).__name__}: {e}"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        engine = server.engine
        if engine is None or engine._dead is not None:
            return JSONResponse({"status": "dead"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        server.metrics.refresh(server.engine)
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "compile_runtime",
                    "max_model_len": server.llm.runner_config.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        return await server.completions(body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> Any:
        return await server.chat(body)

    return app
