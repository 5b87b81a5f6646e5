"""A system reached over HTTP: SGLang's native `/generate` on one server or on sglang-router.

Requests are `{"input_ids", "sampling_params", "stream": true}` with the greedy, EOS-ignoring
params every system serves. The response is server-sent events, `data: {json}` each, then
`data: [DONE]`; as in SGLang, every event carries the CUMULATIVE output ids so far, and the last one
carries the full meta_info (prompt_tokens, completion_tokens, cached_tokens, finish_reason).
sglang-router passes these events through unchanged, so one backend serves both.

The async HTTP client is bound to the event loop that created it: it is made lazily in the running
loop and released by `close_async_resources` (the driver calls it at the end of that loop).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator, Sequence

import httpx2

from sgl_lite.bench.backends import GenerationBackend, StreamEvent, greedy_params
from sgl_lite.lang.backend.http_runtime import sse_data

logger = logging.getLogger(__name__)

# A server busy with a long prefill on a loaded CPU may stay silent this long between events.
READ_TIMEOUT_S = 300.0
# /flush_cache is refused while requests are in flight; the last one of a warm-up may still be
# finishing on the server when its final event reaches us.
FLUSH_ATTEMPTS = 20
FLUSH_RETRY_S = 0.25


class HTTPStreamError(RuntimeError):
    """The server answered an error status, sent an error event, or broke the stream protocol."""


class HTTPBackend(GenerationBackend):
    """Streams `/generate` from `url`. `worker_urls` (the replicas behind a router, when known) are
    warmed and flushed directly; otherwise `url` is. `owned` (something with `stop()`, e.g. a
    sgl_lite.cluster.Cluster) is stopped by `close`."""

    def __init__(self, name: str, url: str, *, api_key: str | None = None,
                 worker_urls: Sequence[str] = (), owned: Any = None) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.owned = owned
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx2.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def _async_client(self) -> httpx2.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # A client left over from a finished loop cannot be closed from this one; its sockets
            # went with that loop.
            self._client = httpx2.AsyncClient(
                headers=self._headers, limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64),
                timeout=httpx2.Timeout(READ_TIMEOUT_S, connect=30.0, pool=None))
            self._client_loop = loop
        return self._client

    async def stream(self, input_ids: list[int], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        async for event in self._stream_from(self.url, input_ids, max_new_tokens):
            yield event

    async def _stream_from(self, base_url: str, input_ids: list[int],
                           max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        body = {"input_ids": input_ids, "sampling_params": greedy_params(max_new_tokens), "stream": True}
        received = 0  # output ids seen so far (events are cumulative)
        finished = False
        async with self._async_client().stream("POST", base_url + "/generate", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise HTTPStreamError(f"{base_url}/generate answered {response.status_code}: {text[:300]}")
            async for data in sse_data(response.aiter_lines()):
                if finished:
                    raise HTTPStreamError(f"{base_url}/generate sent an event after the final one: {data[:200]}")
                event = json.loads(data)
                if "error" in event:
                    raise HTTPStreamError(f"{base_url}/generate stream error: {event['error']}")
                output_ids = event.get("output_ids") or []
                new_ids = [int(t) for t in output_ids[received:]]
                received = max(received, len(output_ids))
                meta = event.get("meta_info") or {}
                finished = meta.get("finish_reason") is not None
                if new_ids or finished:
                    yield StreamEvent(time.perf_counter(), new_ids, meta if finished else None)
        if not finished:
            raise HTTPStreamError(f"{base_url}/generate stream ended without a final event carrying meta_info")

    async def warm_up(self) -> None:
        """Every replica gets its own warm-up request (through a router only one would), then the
        front does, so neither pays one-time costs inside the measured run."""
        for base_url in [*self.worker_urls, self.url]:
            async for _ in self._stream_from(base_url, [1, 2, 3, 4], 2):
                pass

    def reset(self) -> None:
        with httpx2.Client(headers=self._headers, timeout=60.0) as client:
            for base_url in self.worker_urls or [self.url]:
                _flush(client, base_url)

    def replica_prompt_tokens(self) -> list[int] | None:
        if not self.worker_urls:
            return None
        with httpx2.Client(headers=self._headers, timeout=60.0) as client:
            counts = []
            for base_url in self.worker_urls:
                response = client.get(base_url + "/server_info")
                response.raise_for_status()
                counts.append(int(response.json()["prompt_tokens_total"]))
        return counts

    async def close_async_resources(self) -> None:
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None
        self._client_loop = None

    def close(self) -> None:
        self._client = None
        self._client_loop = None
        if self.owned is not None:
            self.owned.stop()


def _flush(client: httpx2.Client, base_url: str) -> None:
    """POST /flush_cache, retrying while the server reports requests in flight. sglang-router answers
    with how many of its workers it flushed: all of them, or this raises."""
    for _ in range(FLUSH_ATTEMPTS):
        response = client.post(base_url + "/flush_cache")
        if response.status_code == 200:
            break
        if response.status_code != 400:
            raise HTTPStreamError(f"{base_url}/flush_cache answered {response.status_code}: {response.text[:300]}")
        time.sleep(FLUSH_RETRY_S)
    else:
        raise HTTPStreamError(f"{base_url}/flush_cache still refused after {FLUSH_ATTEMPTS} attempts: "
                              f"{response.text[:300]}")
    try:
        report = response.json()
    except ValueError:
        return  # a plain server answers "Cache flushed."
    if isinstance(report, dict) and "workers_flushed" in report:
        total = report.get("total_workers", report.get("total_http_workers"))
        if report["workers_flushed"] != total:
            raise HTTPStreamError(f"{base_url}/flush_cache flushed {report['workers_flushed']} of {total} "
                                  f"workers: {report}")
    logger.debug("%s/flush_cache: %s", base_url, response.text.strip())
