"""`create_app(async_engine, settings)`: the FastAPI app and its routes.

The app does not own the engine: whoever built the `AsyncEngine` (the CLI, a
test) shuts it down after the server has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from stepserve.server.auth import APIKeyMiddleware
from stepserve.server.body_limit import BodyLimitMiddleware
from stepserve.server.errors import SafeJSONResponse, install_error_handlers
from stepserve.server.metrics import ServerMetrics
from stepserve.server.native import generate
from stepserve.server.openai_chat import create_chat_completion
from stepserve.server.openai_completions import create_completion
from stepserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from stepserve.server.serving import ClientDisconnected, EngineClient, ServerSettings


def create_app(async_engine, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(async_engine)
    client = EngineClient(async_engine, settings, metrics)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        poll = asyncio.ensure_future(metrics.poll_steps(settings.metrics_poll_s))
        try:
            yield
        finally:
            client.admission.draining = True
            poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poll

    app = FastAPI(title="stepserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM server (completions, chat) with a native token route")
    app.state.client = client
    app.state.metrics = metrics
    app.state.settings = settings
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"

    if settings.max_request_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:  # added last: runs first, so an unauthenticated client learns nothing else
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)

    def model_card() -> dict:
        return {"id": settings.served_model_name, "object": "model", "created": created, "owned_by": "stepserve",
                "max_model_len": client.max_model_len, "vocab_size": client.vocab_size}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(body, request, client)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(body, request, client)

    @app.post("/generate")
    async def native_generate(body: GenerateRequest, request: Request):
        return await generate(body, request, client)

    @app.get("/v1/models")
    async def models():
        return SafeJSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        client.check_model(model)
        return SafeJSONResponse(model_card())

    @app.get("/health")
    async def health():
        if not async_engine.is_alive():
            return SafeJSONResponse({"status": "engine_dead"}, status_code=503)
        if client.admission.draining:
            return SafeJSONResponse({"status": "draining"}, status_code=503)
        return SafeJSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
