"""HttpRuntime: how RuntimeEndpoint speaks SGLang's native HTTP protocol, to a server that names no
ZeroMQ endpoint (sglang-router in front of `serve --dp-size N`, a real SGLang server) or when asked to.

The requests are those of SGLang's own frontend (sglang/lang/backend/runtime_endpoint.py): POST
/generate with {"text", "sampling_params", return_logprob, logprob_start_len, top_logprobs_num}
(max_new_tokens 0: prefill only, for the prefix-cache hint and select scoring), streamed as SSE
`data:` events that each carry the whole text so far, ending with `data: [DONE]`; GET
/get_model_info and /get_server_info (their newer names /model_info and /server_info after a 404);
POST /flush_cache. One prompt per /generate, never a batch body: sglang-router 0.3.2 refuses a list
of texts, and one request per prompt lets its cache-aware policy route each by its own prefix.
With an API key every request carries `Authorization: Bearer <key>`.

One I/O thread runs an asyncio loop with one httpx2.AsyncClient, whose connection pool every program
thread shares; a caller blocks on its coroutine's future, so a select's scoring requests are all in
flight at once without a thread per choice (as over ZeroMQ). Leaving a stream early cancels its
coroutine, which closes the connection, and the server aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import weakref
from typing import Any, AsyncIterator, Coroutine, Iterator, TypeVar

import httpx2
import msgspec

from sgl_lite.lang.backend.base import PrefillRequest
from sgl_lite.lang.ir import SglSamplingParams
from sgl_lite.runtime.client import RuntimeRequestError, RuntimeUnavailableError

T = TypeVar("T")
_CONNECT_TIMEOUT_S = 10.0
_CLOSE_WAIT_S = 5.0
# How much of an error answer goes into the exception's message.
_ERROR_TEXT_CHARS = 500
# Statuses meaning the server (or every worker behind the router) cannot serve now, not a bad request.
_UNAVAILABLE_STATUSES = (502, 503, 504)
_STREAM_END = object()


class HttpRuntime:
    """The SGLang-compatible HTTP server at `base_url`. `timeout` bounds each wait for the server's next
    bytes (connecting: at most 10 s); `verify` is httpx's (and SGLang's): TLS verification, or a CA bundle."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 verify: bool | str = True) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds; got {timeout!r}")
        self.base_url = base_url.rstrip("/")
        self.address = self.base_url
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sgl-lite-http-io", daemon=True)
        self._thread.start()
        self._client: httpx2.AsyncClient = self._run(_new_client(headers, timeout, verify))
        # Dropped without close(): the loop thread would otherwise live as long as the process.
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop, self._thread, self._client)
        self._finalizer.atexit = False

    # ------------------------------------------------------------------ what the endpoint calls

    def server_info(self) -> dict[str, Any]:
        return self._run(self._get_json("/get_server_info", "/server_info"))

    def model_info(self) -> dict[str, Any]:
        return self._run(self._get_json("/get_model_info", "/model_info"))

    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        reply = self._run(self._post_json("/generate", generate_body(text, params)))
        return reply["text"], reply["meta_info"]

    def generate_stream(self, text: str, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Sends the request now; yields (new text, meta_info), the last piece with the final meta_info.
        Closing the iterator early, or dropping it (even before its first piece), aborts the request."""
        pieces: queue.Queue[Any] = queue.Queue()
        future = self._submit(self._stream(generate_body(text, params, stream=True), pieces.put))
        stream = _iterate_stream(future, pieces)
        weakref.finalize(stream, future.cancel).atexit = False  # a generator never started runs no finally
        return stream

    def prefill(self, requests: list[PrefillRequest]) -> list[dict[str, Any]]:
        bodies = [{**({"text": r.text} if r.input_ids is None else {"input_ids": r.input_ids}),
                   "sampling_params": {"max_new_tokens": 0}, "return_logprob": r.return_logprob,
                   "logprob_start_len": r.logprob_start_len} for r in requests]
        return [reply["meta_info"] for reply in self._run(self._post_all("/generate", bodies))]

    def flush_cache(self) -> bool:
        """True when flushed (by a router: on every worker). A server with requests in flight refuses (400)."""
        response = self._run(self._request("POST", "/flush_cache"))
        if response.status_code == 400:
            return False
        _check(response, self.base_url + "/flush_cache")
        with contextlib.suppress(ValueError):
            report = response.json()
            if isinstance(report, dict) and "workers_flushed" in report:  # sglang-router's answer
                return report["workers_flushed"] == report.get("total_workers", report.get("total_http_workers"))
        return True  # a server answers "Cache flushed."

    def close(self) -> None:
        self._closed = True
        self._finalizer()

    # ------------------------------------------------------------------ on the I/O thread

    async def _request(self, method: str, path: str, body: Any = None) -> httpx2.Response:
        url = self.base_url + path
        with _transport_errors(url, self.timeout):
            return await self._client.request(method, url, json=body)

    async def _get_json(self, *paths: str) -> Any:
        """GET the first of `paths` the server has: a 404 tries the next name (SGLang's old and new ones)."""
        for path in paths:
            response = await self._request("GET", path)
            if response.status_code != 404 or path == paths[-1]:
                break
        return _json(response, self.base_url + path)

    async def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        return _json(await self._request("POST", path, body), self.base_url + path)

    async def _post_all(self, path: str, bodies: list[dict[str, Any]]) -> list[Any]:
        """All at once; the first failure is raised and the other requests are cancelled."""
        tasks = [asyncio.ensure_future(self._post_json(path, body)) for body in bodies]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _stream(self, body: dict[str, Any], put: Any) -> None:
        url = self.base_url + "/generate"
        try:
            with _transport_errors(url, self.timeout):
                async with self._client.stream("POST", url, json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        _check(response, url)
                    await _read_events(response, url, put)
        finally:
            put(_STREAM_END)

    # ------------------------------------------------------------------ from the callers' threads

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> Any:
        if self._closed:
            coroutine.close()
            raise RuntimeUnavailableError(f"the endpoint for {self.base_url} is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = self._submit(coroutine)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # the caller was interrupted (or the call failed: then a no-op)
            raise


def generate_body(text: str, params: SglSamplingParams, stream: bool = False) -> dict[str, Any]:
    """SGLang's /generate body for one gen: sampling_params under SGLang's names (the wire's, which are
    SGLang's), max_new_tokens always given, a JSON schema as a string (SGLang takes no object)."""
    runtime_params = params.to_runtime_params()
    sampling = msgspec.to_builtins(runtime_params)  # the fields that differ from the defaults
    sampling["max_new_tokens"] = runtime_params.max_new_tokens
    if isinstance(sampling.get("json_schema"), dict):
        sampling["json_schema"] = json.dumps(sampling["json_schema"])
    body: dict[str, Any] = {"text": text, "sampling_params": sampling, **params.request_options()}
    if params.return_text_in_logprobs:
        body["return_text_in_logprobs"] = True
    if stream:
        body["stream"] = True
    return body


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The payloads of a server-sent event stream's `data:` lines, up to SGLang's closing `data: [DONE]`
    (blank separators and SSE comments skipped)."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield data


async def _read_events(response: httpx2.Response, url: str, put: Any) -> None:
    """Each `data:` event holds the whole text so far: put the part not yet given, with its meta_info."""
    shown = 0
    finished = False
    async for data in sse_data(response.aiter_lines()):
        try:
            event = json.loads(data)
        except ValueError:
            raise RuntimeRequestError(f"{url} sent an event that is not JSON: {data[:_ERROR_TEXT_CHARS]}",
                                      "internal") from None
        if "error" in event:
            raise RuntimeRequestError(f"{url} stream failed: {_error_text(event)}", _error_code(event))
        text = str(event.get("text", ""))
        meta_info = event.get("meta_info") or {}
        put((text[shown:], meta_info))
        shown = max(shown, len(text))
        finished = meta_info.get("finish_reason") is not None
    if not finished:
        raise RuntimeUnavailableError(f"{url} ended the stream before its final event")


def _iterate_stream(future: Any, pieces: queue.Queue[Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        while True:
            piece = pieces.get()
            if piece is _STREAM_END:
                future.result()  # the stream's error, if it ended with one
                return
            yield piece
    finally:
        future.cancel()  # a no-op once the stream ended; aborts a stream left early


@contextlib.contextmanager
def _transport_errors(url: str, timeout: float) -> Iterator[None]:
    """httpx's connection and timeout errors as the runtime client's RuntimeUnavailableError."""
    try:
        yield
    except httpx2.TimeoutException:
        raise RuntimeUnavailableError(f"{url} did not answer within {timeout:g} s") from None
    except httpx2.TransportError as e:
        raise RuntimeUnavailableError(f"no HTTP server answers at {url}: {e!r}") from None


def _check(response: httpx2.Response, url: str) -> None:
    """Raise for an error status: RuntimeRequestError naming the server's message (code unauthorized for
    401/403), RuntimeUnavailableError for 502-504 (nobody behind the router can serve)."""
    if response.status_code == 200:
        return
    message = f"{url} answered {response.status_code}: {_error_text(_body(response))}"
    if response.status_code in _UNAVAILABLE_STATUSES:
        raise RuntimeUnavailableError(message)
    code = "unauthorized" if response.status_code in (401, 403) else "bad_request" if response.status_code < 500 \
        else "internal"
    raise RuntimeRequestError(message, code)


def _json(response: httpx2.Response, url: str) -> Any:
    _check(response, url)
    try:
        return response.json()
    except ValueError:
        raise RuntimeRequestError(f"{url} did not answer JSON: {response.text[:_ERROR_TEXT_CHARS]}",
                                  "internal") from None


def _body(response: httpx2.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _error_text(payload: Any) -> str:
    """The message of SGLang's and OpenAI's error shapes ({"error": {"message"}}, {"error": str}), FastAPI's
    ({"detail"}), or the raw answer."""
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail", payload))
        if isinstance(error, dict):
            error = error.get("message", error)
        payload = error
    return str(payload)[:_ERROR_TEXT_CHARS]


def _error_code(event: dict[str, Any]) -> str:
    error = event.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else "bad_request"


async def _new_client(headers: dict[str, str], timeout: float, verify: bool | str) -> httpx2.AsyncClient:
    """Made on the I/O thread's loop, which its connections belong to."""
    return httpx2.AsyncClient(headers=headers, verify=verify,
                              timeout=httpx2.Timeout(timeout, connect=min(timeout, _CONNECT_TIMEOUT_S)),
                              limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64))


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: httpx2.AsyncClient) -> None:
    """Close the client's connections (cancelling streams still open), then stop and close the loop."""
    if loop.is_closed():
        return
    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(_CLOSE_WAIT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(_CLOSE_WAIT_S)
    if not thread.is_alive():
        loop.close()
