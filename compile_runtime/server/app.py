"""``compile-runtime serve``: the FastAPI app, its routes and its lifespan over one ``Server``.

The routes of vLLM's OpenAI server that a client of it uses: ``/v1/completions`` and
``/v1/chat/completions`` (streamed as server-sent events ending with ``data: [DONE]``, or
whole), ``/v1/responses`` (and ``GET /v1/responses/{id}``), ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/health``, ``/ping``,
``/version`` and ``/metrics`` (Prometheus). A failure is an OpenAI-style error body and
the server goes on; every request is one access-log line. Around the routes: the API key
check (``api_keys.py``), the body size bound (``request_limits.py``) and, only when
origins are given, CORS.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from compile_runtime.server import tokenization
from compile_runtime.server.access_log import AccessLog
from compile_runtime.server.api_error import APIError
from compile_runtime.server.api_keys import ApiKeyAuth
from compile_runtime.server.chat_completions import chat as chat_completions
from compile_runtime.server.completions import completions as text_completions
from compile_runtime.server.errors import add_error_handlers
from compile_runtime.server.handlers import Server
from compile_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ResponsesRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from compile_runtime.server.request_body import body_of
from compile_runtime.server.request_limits import BodySizeLimit, RequestLimits
from compile_runtime.server.responses import responses
from compile_runtime.version import __version__

# vLLM's ModelPermission, as its /v1/models lists it: sampling and logprobs, nothing else.
PERMISSION = {"object": "model_permission", "created": 0, "allow_create_engine": False,
              "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
              "allow_view": True, "allow_fine_tuning": False, "organization": "*",
              "group": None, "is_blocking": False}  # fmt: skip


def build_app(
    server: Server,
    *,
    api_keys: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    limits: RequestLimits = RequestLimits(),
) -> FastAPI:
    """``api_keys``: none lets anyone in; ``allowed_origins``: none turns CORS off."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop)  # running requests finish first

    app = FastAPI(title="compile_runtime", version=__version__, lifespan=lifespan)
    if api_keys:
        app.add_middleware(ApiKeyAuth, keys=api_keys)
    app.add_middleware(
        BodySizeLimit, max_bytes=limits.max_body_bytes, in_flight=limits.max_body_bytes_in_flight
    )
    server.pool.timeout_s = server.compile_pool.timeout_s = limits.prepare_seconds
    if allowed_origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
            allow_headers=["*"],
        )  # fmt: skip
    app.add_middleware(AccessLog)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        engine = server.engine
        if engine is None or engine.dead_reason is not None:
            return JSONResponse({"status": "dead"}, status_code=503)
        if engine.stopping:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        server.metrics.refresh(server.engine)
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "compile_runtime",
            "root": server.model_name,
            "parent": None,
            "max_model_len": server.max_model_len,
            "permission": [PERMISSION | {"id": f"modelperm-{server.model_name}"}],
        }
        return {"object": "list", "data": server.adapters.cards(card)}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(
        body: Annotated[LoadLoRAAdapterRequest, Depends(body_of(LoadLoRAAdapterRequest))],
    ) -> Response:
        server.adapters.check_updating()
        # Reading an adapter takes a while: in a worker, the adapter names registered at once.
        await server.pool.run(server.adapters.add, body.lora_name, body.lora_path,
                              what="loading the adapter", param="lora_path")  # fmt: skip
        message = f"Success: LoRA adapter '{body.lora_name}' added successfully."
        return Response(message, media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(
        body: Annotated[UnloadLoRAAdapterRequest, Depends(body_of(UnloadLoRAAdapterRequest))],
    ) -> Response:
        server.adapters.check_updating()
        server.adapters.remove(body.lora_name)
        message = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
        return Response(message, media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(
        body: Annotated[CompletionRequest, Depends(body_of(CompletionRequest))], request: Request
    ) -> Any:
        limits.check(body)
        return await text_completions(server, body, request.state.tokens)

    @app.post("/v1/chat/completions")
    async def chat(
        body: Annotated[ChatCompletionRequest, Depends(body_of(ChatCompletionRequest))],
        request: Request,
    ) -> Any:
        limits.check(body)
        return await chat_completions(server, body, request.state.tokens)

    @app.post("/v1/responses")
    async def create_response(
        body: Annotated[ResponsesRequest, Depends(body_of(ResponsesRequest))], request: Request
    ) -> Any:
        return await responses(server, body, request.state.tokens)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return server.responses.get(response_id)[0]

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict:
        server.responses.get(response_id)  # 404 when unknown
        raise APIError(400, "Cannot cancel a synchronous response.", "response_id")

    @app.post("/tokenize")
    async def tokenize(body: Annotated[TokenizeRequest, Depends(body_of(TokenizeRequest))]) -> dict:
        tok = server.llm.tokenizer
        return await server.pool.run(
            tokenization.tokenize, body, tok, server.adapters, server.max_model_len,
            server.trust_request_chat_template, what="tokenizing", param="prompt",
            interrupt=body.messages is not None,
        )  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(
        body: Annotated[DetokenizeRequest, Depends(body_of(DetokenizeRequest))],
    ) -> dict:
        return await server.pool.run(
            tokenization.detokenize, body, server.llm.tokenizer, server.adapters,
            what="detokenizing", param="tokens",
        )  # fmt: skip

    return app
