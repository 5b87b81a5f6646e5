"""One runtime generation as seen by the HTTP front: streamed from RuntimeClient, timed, accounted.

Every HTTP generation (streamed to the caller or not) is run as a runtime stream, so that TTFT and
inter-token latency are measured the same way for both. A stream that ends early (the HTTP client
went away, a sibling choice failed) is closed, and closing a RuntimeClient stream aborts its
runtime request, so no KV stays held for nobody.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio

from sgl_lite.http.errors import HttpError, from_runtime_error
from sgl_lite.http.guards.request_owner import CURRENT_CALLER, RequestOwners
from sgl_lite.http.metrics import HttpMetrics
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.runtime.protocol import SamplingParams, SessionPin


@dataclass
class GenerationInput:
    text: str | None
    input_ids: list[int] | None
    sampling_params: SamplingParams  # validated before anything is sent
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    priority: int | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    session_pin: SessionPin | None = None  # a session's request: its KV is kept as the session's prefix


@dataclass
class Delta:
    """New output of one request since its previous Delta; `meta_info` is the runtime's latest."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    finish_reason: dict[str, Any] | None  # set on the last Delta only


@dataclass
class Generation:
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]

    @property
    def finish_reason(self) -> dict[str, Any]:
        return self.meta_info.get("finish_reason") or {"type": "stop"}


class RequestRunner:
    def __init__(self, client: RuntimeClient, metrics: HttpMetrics) -> None:
        self._client = client
        self._metrics = metrics
        self.owners = RequestOwners()  # the caller of each running generation, by rid

    async def stream(self, request: GenerationInput) -> AsyncIterator[Delta]:
        """Deltas of one request; the last has finish_reason. Raises HttpError (an abort other than by
        /abort_request too).

        Closing this generator early closes the client's stream, which aborts the runtime request.
        """
        label = self._metrics.priority_label(request.priority)
        start = time.perf_counter()
        last_token_time: float | None = None
        # whose request this is while it runs, for /abort_request (guards/request_owner.py)
        with self.owners.running(request.rid, CURRENT_CALLER.get()):
            chunks = self._client.async_generate_stream(
                text=request.text,
                input_ids=request.input_ids,
                sampling_params=request.sampling_params,
                return_logprob=request.return_logprob,
                logprob_start_len=request.logprob_start_len,
                top_logprobs_num=request.top_logprobs_num,
                priority=request.priority,
                rid=request.rid,
                session_pin=request.session_pin,
            )
            try:
                async with aclosing(chunks):
                    async for chunk in chunks:
                        now = time.perf_counter()
                        num_new = len(chunk.output_ids)
                        if num_new and last_token_time is None:
                            self._metrics.observe_first_token(label, now - start)
                        elif num_new:
                            # A chunk may carry several tokens (the detokenizer holds back incomplete
                            # characters and possible stop strings); spread the gap over them.
                            self._metrics.observe_inter_token(label, (now - last_token_time) / num_new, num_new)
                        if num_new:
                            last_token_time = now
                        # {"type": "abort"} too, when /abort_request ended it: the output so far is its answer
                        finish_reason = chunk.meta_info.get("finish_reason")
                        if finish_reason:
                            self._metrics.observe_finished(chunk.meta_info, label, now - start)
                        # After the final chunk the client's stream ends by itself (on the Finished reply).
                        yield Delta(chunk.text, list(chunk.output_ids), chunk.meta_info, finish_reason or None)
            except HttpError:
                raise
            except Exception as e:
                raise from_runtime_error(e) from e

    async def collect(self, request: GenerationInput) -> Generation:
        """Run one request to its end and return its whole output."""
        texts: list[str] = []
        output_ids: list[int] = []
        meta_info: dict[str, Any] = {}
        async with aclosing(self.stream(request)) as deltas:
            async for delta in deltas:
                texts.append(delta.text)
                output_ids.extend(delta.output_ids)
                meta_info = delta.meta_info
        return Generation("".join(texts), output_ids, meta_info)

    async def collect_many(self, requests: list[GenerationInput]) -> list[Generation]:
        """Run requests concurrently; the first failure cancels (and so aborts) the others."""
        tasks = [asyncio.ensure_future(self.collect(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            await _cancel_all(tasks)

    async def stream_many(self, requests: list[GenerationInput]) -> AsyncIterator[tuple[int, Delta]]:
        """(index, Delta) of several concurrent requests as they arrive; the first failure ends all."""
        if len(requests) == 1:
            async with aclosing(self.stream(requests[0])) as deltas:
                async for delta in deltas:
                    yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, Delta | None, Exception | None]] = asyncio.Queue()

        async def pump(index: int, request: GenerationInput) -> None:
            try:
                async with aclosing(self.stream(request)) as deltas:
                    async for delta in deltas:
                        await queue.put((index, delta, None))
            except Exception as e:
                await queue.put((index, None, e))
                return
            await queue.put((index, None, None))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
        try:
            remaining = len(tasks)
            while remaining:
                index, delta, error = await queue.get()
                if error is not None:
                    raise error
                if delta is None:
                    remaining -= 1
                    continue
                yield index, delta
        finally:
            await _cancel_all(tasks)


async def _cancel_all(tasks: list[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*tasks, return_exceptions=True)
