"""The HTTP front: an OpenAI-compatible and SGLang-native API over one runtime, as a FastAPI app.

It talks to the runtime only through `RuntimeClient`. With an API key, every route but /health
requires `Authorization: Bearer <key>` (/health stays open so that load balancers and sglang-router
can probe liveness without the secret; it reveals nothing but up/down).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_lite.http.errors import HttpError, from_runtime_error
from sgl_lite.http.generation import RequestRunner
from sgl_lite.http.guards.api_key import api_key_error, bearer_key_matches
from sgl_lite.http.guards.disconnect import cancel_on_disconnect
from sgl_lite.http.guards.limits import HttpLimits, RequestGuard, parse_body
from sgl_lite.http.guards.validation import validation_error
from sgl_lite.http.metrics import CONTENT_TYPE, HttpMetrics
from sgl_lite.http.model_context import ModelContextCache
from sgl_lite.http.openai_api.protocol import AbortRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest
from sgl_lite.http.openai_api.serving import OpenAIServing
from sgl_lite.http.sglang_api.generate import flush_cache_response, generate
from sgl_lite.http.sglang_api.tokenize import add_tokenize_routes
from sgl_lite.http.sglang_api.worker_api import add_worker_routes
from sgl_lite.runtime.client import RuntimeClient

logger = logging.getLogger(__name__)

GENERATION_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/generate")
HEALTH_TIMEOUT_S = 2.0
# How long /health stays 200 for a runtime that is connected (answering ZMTP heartbeats) but whose
# scheduler loop has not answered a readiness probe: one long step may take this long; a loop that
# stays silent longer is taken as hung, so a router stops sending it work.
STEP_GRACE_S = 60.0


def create_app(client: RuntimeClient, *, api_key: str | None = None, served_model_name: str | None = None,
               limits: HttpLimits = HttpLimits()) -> FastAPI:
    """Build the app over `client`; the caller owns the client (and closes it after the server stops)."""
    # /openapi.json is served below, behind the API key like every route but /health.
    app = FastAPI(title="sgl_lite", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGuard, max_body_bytes=limits.max_request_body_bytes, api_key=api_key)
    metrics = HttpMetrics()
    runner = RequestRunner(client, metrics)
    contexts = ModelContextCache(client.server_info, served_model_name)
    serving = OpenAIServing(runner, contexts, limits)
    app.state.metrics = metrics

    def count(endpoint: str) -> Callable[[str], None]:
        return lambda outcome: metrics.count_request(endpoint, outcome)

    async def require_api_key(request: Request) -> None:
        if api_key is not None and not bearer_key_matches(request.headers.get("authorization", ""), api_key):
            raise api_key_error()

    protected = [Depends(require_api_key)]

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, exc: HttpError) -> Response:
        if exc.status >= 500:  # every server-side failure leaves a trace in the log
            logger.warning("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message)
        _count_failure(request, metrics, exc)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        error = validation_error(exc)
        _count_failure(request, metrics, error)
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException) -> Response:
        return HttpError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        error = from_runtime_error(exc)
        if error.code == "internal":
            logger.exception("unhandled error on %s", request.url.path)
        _count_failure(request, metrics, error)
        return error.response()

    last_ready: list[float] = []  # when the scheduler loop last answered a readiness probe

    @app.get("/health")
    async def health() -> Response:
        if await anyio.to_thread.run_sync(lambda: _probe(client.health)):
            last_ready[:] = [time.monotonic()]
            return Response(status_code=200)
        # Busy in one long step: alive (heartbeats) and ready not long ago.
        if client.is_connected() and last_ready and time.monotonic() - last_ready[0] < STEP_GRACE_S:
            return Response(status_code=200)
        raise HttpError(503, "the runtime is not answering", code="runtime_unavailable")

    @app.get("/v1/models", dependencies=protected)
    async def models() -> dict[str, Any]:
        context = await contexts.get()
        return {"object": "list", "data": [{
            "id": context.served_model_name, "object": "model", "created": 0, "owned_by": "sgl_lite",
            "root": context.model_info.get("model_path"), "max_model_len": context.context_length,
        }]}

    # Bodies are parsed by parse_body (off the event loop when large); generations are cancelled,
    # and so aborted, when their client disconnects before the response starts.
    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        body_bytes = len(await request.body())  # read once, by parse_body: starlette keeps it
        response = await cancel_on_disconnect(request, serving.chat(body, count("/v1/chat/completions"), body_bytes))
        _count_unless_streaming(metrics, "/v1/chat/completions", body.stream)
        return response

    @app.post("/v1/completions", dependencies=protected)
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        response = await cancel_on_disconnect(request, serving.completions(body, count("/v1/completions")))
        _count_unless_streaming(metrics, "/v1/completions", body.stream)
        return response

    @app.post("/generate", dependencies=protected)
    async def native_generate(request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        token_texts = (await contexts.get()).token_texts if body.return_text_in_logprobs else None
        response = await cancel_on_disconnect(
            request, generate(runner, body, count("/generate"), token_texts, max_fanout=limits.max_request_fanout))
        _count_unless_streaming(metrics, "/generate", body.stream)
        return response

    @app.post("/abort_request", dependencies=protected)
    async def abort_request(request: Request) -> dict[str, Any]:
        """SGLang's: abort a /generate request by the rid it was given, or every request this front is
        running with abort_all; each caller gets its output so far with finish_reason {"type": "abort"}
        ("abort" on the OpenAI routes). Answers how many were running."""
        body = await parse_body(request, AbortRequest)
        rids = client.in_flight() if body.abort_all else [body.rid]
        return {"aborted": sum(client.abort_in_flight(rid) for rid in rids)}

    @app.get("/openapi.json", dependencies=protected, include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=protected)
    async def flush_cache() -> Response:
        return flush_cache_response(await _call(client.flush_cache))

    async def health_generate() -> None:
        body = GenerateRequest(text="ping", sampling_params={"max_new_tokens": 1, "temperature": 0})
        await generate(runner, body, lambda outcome: None, max_fanout=1)

    add_tokenize_routes(app, contexts, limits, protected)
    add_worker_routes(app, server_info=lambda: _call(client.server_info), contexts=contexts,
                      health_generate=health_generate, protected=protected, runtime_address=client.address)

    @app.get("/metrics", dependencies=protected)
    async def prometheus_metrics() -> Response:
        try:
            info = await _call(client.server_info)
        except HttpError:
            info = None  # still export what the front measured; runtime_up says the runtime is gone
        return Response(metrics.render(info, served_model_name), media_type=CONTENT_TYPE)

    return app


def _probe(health: Callable[..., bool]) -> bool:
    try:
        return bool(health(timeout=HEALTH_TIMEOUT_S))
    except Exception:
        return False


async def _call(fn: Callable[[], Any]) -> Any:
    """A blocking RuntimeClient call, off the event loop, with runtime errors mapped to HttpError."""
    try:
        return await anyio.to_thread.run_sync(fn)
    except Exception as e:
        raise from_runtime_error(e) from e


def _count_unless_streaming(metrics: HttpMetrics, endpoint: str, stream: bool) -> None:
    # A stream is counted when it ends (by sse_response), since it can still fail after the headers.
    if not stream:
        metrics.count_request(endpoint, "success")


def _count_failure(request: Request, metrics: HttpMetrics, error: HttpError) -> None:
    if request.url.path in GENERATION_ENDPOINTS:
        metrics.count_request(request.url.path, error.outcome)
