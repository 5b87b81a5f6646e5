"""The HTTP front: an OpenAI-compatible and SGLang-native API over one runtime, as a FastAPI app.

It talks to the runtime only through `RuntimeClient`. With an API key, every route but /health
requires `Authorization: Bearer <key>` (/health stays open so that load balancers and sglang-router
can probe liveness without the secret; it reveals nothing but up, busy or down). /abort_request takes
the admin key (--admin-api-key) too, which it needs for more than the caller's own requests.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_lite.http.errors import HttpError, bad_request, from_runtime_error
from sgl_lite.http.generation import RequestRunner
from sgl_lite.http.guards.access_log import AccessLog
from sgl_lite.http.guards.api_key import api_key_error, bearer_key_matches
from sgl_lite.http.guards.disconnect import cancel_on_disconnect
from sgl_lite.http.guards.limits import HttpLimits, RequestGuard, parse_body
from sgl_lite.http.guards.prompt_budget import Prompt, check_batch_prompts
from sgl_lite.http.guards.request_owner import CURRENT_CALLER, rids_to_abort
from sgl_lite.http.guards.validation import validation_error
from sgl_lite.http.metrics import CONTENT_TYPE, HttpMetrics
from sgl_lite.http.model_context import ModelContextCache
from sgl_lite.http.openai_api.protocol import AbortRequest, ChatCompletionRequest, CompletionRequest
from sgl_lite.http.openai_api.response_store import ResponseStore
from sgl_lite.http.openai_api.responses import add_responses_routes
from sgl_lite.http.openai_api.serving import OpenAIServing
from sgl_lite.http.sglang_api.generate import flush_cache_response, generate
from sgl_lite.http.sglang_api.generate_request import GenerateRequest
from sgl_lite.http.sglang_api.session_api import SessionBinder, add_session_routes
from sgl_lite.http.sglang_api.sessions import SessionStore
from sgl_lite.http.sglang_api.tokenize import add_tokenize_routes
from sgl_lite.http.sglang_api.worker_api import add_worker_routes
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError

logger = logging.getLogger(__name__)

GENERATION_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate")
# How long /health waits for the scheduler loop's answer (it answers between steps) before it says "busy".
HEALTH_TIMEOUT_S = 2.0


def create_app(client: RuntimeClient, *, api_key: str | None = None, served_model_name: str | None = None,
               limits: HttpLimits = HttpLimits(), response_store: ResponseStore | None = None,
               admin_api_key: str | None = None, log_requests: bool = False,
               session_store: SessionStore | None = None) -> FastAPI:
    """Build the app over `client`; the caller owns the client (and closes it after the server stops).
    `response_store`: where /v1/responses keeps responses (default: a ResponseStore of the default bounds).
    `admin_api_key`: the key of /abort_request beyond the caller's own requests (guards/request_owner.py).
    `log_requests`: the access log (guards/access_log.py) also writes each request's body, bounded.
    `session_store`: where SGLang's sessions are kept (default: a SessionStore of the default bounds)."""
    if admin_api_key is not None and (admin_api_key == "" or admin_api_key == api_key):
        raise ValueError("--admin-api-key must not be empty nor equal to --api-key (every caller would be admin)")
    # /openapi.json is served below, behind the API key like every route but /health.
    app = FastAPI(title="sgl_lite", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGuard, max_body_bytes=limits.max_request_body_bytes, api_key=api_key,
                       admin_api_key=admin_api_key)
    app.add_middleware(AccessLog, log_bodies=log_requests)  # added last: outermost, it sees refused requests too
    metrics = HttpMetrics()
    runner = RequestRunner(client, metrics)
    contexts = ModelContextCache(client.server_info, served_model_name)
    serving = OpenAIServing(runner, contexts, limits)
    store = session_store if session_store is not None else SessionStore()

    def unpin(session_id: str) -> None:  # a session ended: the runtime stops keeping its prefix last
        with contextlib.suppress(RuntimeRequestError):  # a closed client (its pins expire in the runtime)
            client.unpin_session(session_id)

    store.on_end = unpin
    sessions = SessionBinder(store, contexts, serving.prompt_work, client.abort_in_flight)
    app.state.metrics = metrics

    def count(endpoint: str) -> Callable[[str], None]:
        return lambda outcome: metrics.count_request(endpoint, outcome)

    async def require_api_key(request: Request) -> None:
        if api_key is not None and not bearer_key_matches(request.headers.get("authorization", ""), api_key):
            raise api_key_error()

    protected = [Depends(require_api_key)]

    def is_admin(request: Request) -> bool:
        return admin_api_key is not None and bearer_key_matches(request.headers.get("authorization", ""), admin_api_key)

    async def require_api_key_or_admin(request: Request) -> None:
        if api_key is not None and not is_admin(request):
            await require_api_key(request)

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

    @app.get("/health")
    async def health() -> Response:
        """SGLang's /health, answered by this front whatever the runtime's step length: 200 when the
        scheduler loop answers (between steps); 200 {"status": "busy"} while it is inside a step that
        outlasts HEALTH_TIMEOUT_S but its process is alive (its connection answers ZMTP heartbeats; a step
        that never ends is --watchdog-timeout's to end, and the connection with it); 503 when the runtime
        is gone, unreachable or not up yet."""
        if await anyio.to_thread.run_sync(lambda: _probe(client.health)):
            return Response(status_code=200)
        if client.is_connected():
            return JSONResponse({"status": "busy", "message": "the runtime is alive, inside a long scheduler step"})
        raise HttpError(503, "the runtime is not answering", code="runtime_unavailable")

    @app.get("/v1/models", dependencies=protected)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [(await contexts.get()).model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=protected)
    async def model(model_id: str) -> dict[str, Any]:
        context = await contexts.get()
        context.check_model(model_id, required=True)
        return context.model_card()

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

    async def check_batch(prompts: Sequence[Prompt], field: str) -> None:
        context = await contexts.get()
        await check_batch_prompts(context.budget, prompts, field, context.token_texts, serving.prompt_work)

    @app.post("/generate", dependencies=protected)
    async def native_generate(request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        if body.no_logs and (log_requests or (await contexts.get()).logs_requests):
            raise bad_request("no_logs: this server writes every request's text to its log (--log-requests)", "no_logs")
        token_texts = (await contexts.get()).token_texts if body.return_text_in_logprobs else None
        response = await cancel_on_disconnect(
            request, generate(runner, body, count("/generate"), token_texts, max_fanout=limits.max_request_fanout,
                              check_batch=check_batch, sessions=sessions))
        _count_unless_streaming(metrics, "/generate", body.stream)
        return response

    @app.post("/abort_request", dependencies=[Depends(require_api_key_or_admin)])
    async def abort_request(request: Request) -> dict[str, Any]:
        """SGLang's: abort a /generate request by the rid it was given, or every request this front is
        running with abort_all; each caller gets its output so far with finish_reason {"type": "abort"}
        ("abort" on the OpenAI routes). Answers how many were running. A caller aborts the requests it
        started; abort_all and others' requests need the admin key (guards/request_owner.py)."""
        body = await parse_body(request, AbortRequest)
        rids = rids_to_abort(body.rid, body.abort_all, caller=CURRENT_CALLER.get(), admin=is_admin(request),
                             owners=runner.owners, in_flight=client.in_flight(), admin_api_key=admin_api_key)
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

    add_tokenize_routes(app, contexts, limits, protected, serving.prompt_work)
    add_session_routes(app, sessions.store, protected)
    app.state.responses = add_responses_routes(app, serving, runner, limits, metrics, protected, response_store)
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
