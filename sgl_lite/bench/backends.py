"""What the load driver talks to: a system that streams the greedy continuation of token ids.

Every system serves the same request shape: input_ids in, `max_new_tokens` greedy tokens out with
EOS ignored (so output lengths are fixed and runs are comparable). The driver times what it sees.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from sgl_lite.runtime.client import RuntimeClient


@dataclass
class StreamEvent:
    """New output ids at `time` (perf_counter). The last event of a request has `meta_info` set
    (prompt_tokens, completion_tokens, cached_tokens, finish_reason)."""

    time: float
    new_ids: list[int]
    meta_info: dict[str, Any] | None = None


class GenerationBackend(abc.ABC):
    """Contract: `stream` yields StreamEvents in order, ending with exactly one whose meta_info is
    set, or raises; it is safe to run many `stream`s concurrently on one event loop."""

    name: str
    # Shown under the table when a system's latencies are not plain client-side stream timings.
    latency_note: str = ""

    @abc.abstractmethod
    def stream(self, input_ids: list[int], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        ...

    def stream_turn(self, pieces: Sequence[Sequence[int]], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        """A conversation's turn whose prompt is `pieces` joined: the user's and the model's turns in turn,
        the user's first and last (a session's first prompt, then each answer and the observation after
        it). By default the joined prompt, as `stream` takes it; a chat backend may send the turns as messages."""
        return self.stream([t for piece in pieces for t in piece], max_new_tokens)

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget cross-request state (prefix cache), so a measured run starts cold."""

    @abc.abstractmethod
    def close(self) -> None:
        ...

    def replica_prompt_tokens(self) -> list[int] | None:
        """Prompt tokens each replica of the system has served so far (its counters), for systems
        that spread requests over replicas; None for the others."""
        return None

    async def close_async_resources(self) -> None:
        """Release what is bound to the running event loop (connection pools). The driver calls it
        at the end of every loop in which it used the backend; the default holds nothing."""

    async def warm_up(self) -> None:
        """One short request, so one-time costs (lazy init, allocator growth) stay out of the run."""
        async for _ in self.stream([1, 2, 3, 4], 2):
            pass


def greedy_params(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


class RuntimeBackend(GenerationBackend):
    """An sgl_lite runtime over ZeroMQ; owns (and shuts down) `runtime` when given one."""

    def __init__(self, name: str, client: RuntimeClient, runtime: Any = None) -> None:
        self.name = name
        self.client = client
        self.runtime = runtime

    async def stream(self, input_ids: list[int], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        final: dict[str, Any] | None = None
        async for chunk in self.client.async_generate_stream(input_ids=input_ids,
                                                             sampling_params=greedy_params(max_new_tokens)):
            if chunk.meta_info.get("finish_reason") is not None:
                final = chunk.meta_info
            if chunk.output_ids:
                yield StreamEvent(time.perf_counter(), list(chunk.output_ids))
        if final is None:
            raise RuntimeError("the runtime's stream ended without a final chunk carrying meta_info")
        # The stream ends on the Finished message, right after the last chunk: that is e2e.
        yield StreamEvent(time.perf_counter(), [], final)

    def reset(self) -> None:
        if not self.client.flush_cache():
            raise RuntimeError(f"{self.name}: the runtime refused to flush its cache (requests in flight?)")

    def close(self) -> None:
        self.client.close()
        if self.runtime is not None:
            self.runtime.shutdown()
