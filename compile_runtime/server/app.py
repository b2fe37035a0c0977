"""``compile-runtime serve``: the FastAPI app, its routes and its lifespan over one ``Server``.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events ending
with ``data: [DONE]``, or whole), ``/v1/models``, ``/health`` and ``/metrics``
(Prometheus). A failure is an OpenAI-style error body and the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from compile_runtime.server.errors import add_error_handlers
from compile_runtime.server.handlers import Server
from compile_runtime.server.protocol import ChatCompletionRequest, CompletionRequest


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop)  # running requests finish first

    app = FastAPI(title="compile_runtime", lifespan=lifespan)
    add_error_handlers(app)

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
