"""`create_app(async_engine, settings)`: the FastAPI app and its routes.

The app does not own the engine: whoever built the `AsyncEngine` (the CLI, a
test) shuts it down after the server has stopped. If the engine dies, the app
logs why once, stops admitting requests (in-flight ones fail: see `serving`)
and calls `on_engine_death`, with which `stepserve serve` exits non-zero so
that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable

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
from stepserve.server.openai_responses import ResponseStore, ResponsesRequest, create_response
from stepserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest,
                                       TokenizeRequest)
from stepserve.server.shutdown_cut import ShutdownCutMiddleware
from stepserve.server.tokenize import detokenize, tokenize
from stepserve.server.serving import ClientDisconnected, EngineClient, ServerSettings

# SGLang's speculative_algorithm for each of stepserve's proposers (None: no speculation)
SPECULATIVE_ALGORITHMS = {"draft": "STANDALONE", "ngram": "NGRAM"}

log = logging.getLogger("stepserve.server")


def create_app(async_engine, settings: ServerSettings,
               on_engine_death: Callable[[BaseException], None] | None = None) -> FastAPI:
    metrics = ServerMetrics(async_engine)
    client = EngineClient(async_engine, settings, metrics)
    created = int(time.time())

    async def watch_engine(died: asyncio.Future) -> None:
        err = await died
        client.admission.draining = True
        log.error("the engine died, so this server stops serving: %s", err)
        if on_engine_death is not None:
            on_engine_death(err)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        died: asyncio.Future = loop.create_future()

        def report(err: BaseException) -> None:  # from the thread that saw the engine die
            with contextlib.suppress(RuntimeError):  # our loop is already closed
                loop.call_soon_threadsafe(lambda: died.done() or died.set_result(err))

        async_engine.on_death(report)
        tasks = [asyncio.ensure_future(metrics.poll_steps(settings.metrics_poll_s)),
                 asyncio.ensure_future(watch_engine(died))]
        try:
            yield
        finally:
            client.admission.draining = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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
    if settings.api_key:  # added late: runs early, so an unauthenticated client learns nothing else
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(ShutdownCutMiddleware)  # outermost: sees every request uvicorn cancels

    def model_card() -> dict:
        return {"id": settings.served_model_name, "object": "model", "created": created, "owned_by": "stepserve",
                "root": client.model_path, "parent": None, "permission": [],
                "max_model_len": client.max_model_len, "vocab_size": client.vocab_size}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(body, request, client)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(body, request, client)

    responses = ResponseStore()

    @app.post("/v1/responses")
    async def create_responses(body: ResponsesRequest, request: Request):
        return await create_response(body, request, client, responses)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return SafeJSONResponse(responses.get(response_id)[0])

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return SafeJSONResponse(await responses.cancel(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        await responses.delete(response_id)
        return SafeJSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/generate")
    async def native_generate(body: GenerateRequest, request: Request):
        return await generate(body, request, client)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(body, client)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return await detokenize(body, client)

    @app.get("/v1/models")
    async def models():
        return SafeJSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        client.check_model(model)
        return SafeJSONResponse(model_card())

    async def server_info():
        """SGLang's `GET /get_server_info` (and `/server_info`): how the engine
        is sized and schedules, under SGLang's names where it has them, so
        that its clients read them, then stepserve's own. `stepserve profile
        --url` reads it to model the server as it runs."""
        import stepserve

        info = async_engine.info
        return SafeJSONResponse({
            "model_path": info.model, "tokenizer_path": info.tokenizer, "served_model_name": settings.served_model_name,
            "context_length": info.max_model_len, "max_running_requests": info.max_running,
            "max_total_num_tokens": info.kv_capacity, "page_size": 1, "chunked_prefill_size": info.max_batched_tokens,
            "disable_overlap_schedule": not info.overlap_schedule,
            "speculative_algorithm": SPECULATIVE_ALGORITHMS.get(info.speculative),
            "attention_backend": info.attention_backend, "dtype": info.dtype, "device": info.device,
            "vocab_size": info.vocab_size, "version": stepserve.__version__,
            "max_batched_tokens": info.max_batched_tokens, "overlap_schedule": info.overlap_schedule,
            "speculative": info.speculative, "fold_tokens": info.fold_tokens, "fold_pairs": info.fold_pairs,
        })

    app.add_api_route("/get_server_info", server_info, methods=["GET"])
    app.add_api_route("/server_info", server_info, methods=["GET"])

    @app.get("/version")
    async def version():
        import stepserve

        return {"version": stepserve.__version__}

    @app.get("/health")
    async def health():
        if not async_engine.is_alive():
            return SafeJSONResponse({"status": "engine_dead"}, status_code=503)
        if client.admission.draining:
            return SafeJSONResponse({"status": "draining"}, status_code=503)
        return SafeJSONResponse({"status": "ok"})

    async def flush_cache():
        """SGLang's `/flush_cache` (GET or POST) and vLLM's `POST /reset_prefix_cache`:
        the prefix cache let go of every prefix no request holds, so that a
        benchmark's next run starts cold. Prefixes of requests in flight stay
        until they finish (SGLang refuses while any run; this never fails)."""
        f = await async_engine.flush_cache()  # a dead engine: EngineDeadError, answered 503 as everywhere
        log.info("prefix cache flushed: %d cached tokens freed, %d held by requests in flight", f.freed, f.held)
        return SafeJSONResponse({"object": "cache.flush", "flushed_tokens": f.freed, "held_tokens": f.held})

    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])
    app.add_api_route("/reset_prefix_cache", flush_cache, methods=["POST"])

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
