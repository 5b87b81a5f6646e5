"""ZmqRuntime: how RuntimeEndpoint talks to an sgl_lite runtime over ZeroMQ (RuntimeClient).

One RuntimeClient (thread-safe; one I/O thread) serves every program thread. Prefill-only batches
(select scoring) are sent concurrently so the runtime can put them in one batch. The runtime's own
server_info holds the model's chat template, so the endpoint needs nothing else.
"""

from __future__ import annotations

from typing import Any, Iterator

from sgl_lite.lang.backend.base import PrefillRequest
from sgl_lite.lang.ir import SglSamplingParams
from sgl_lite.runtime.client import RuntimeClient, RuntimeUnavailableError

_CONNECT_TIMEOUT_S = 10.0


class ZmqRuntime:
    """The runtime at ZeroMQ `address` (tcp:// or ipc://); RuntimeUnavailableError when it does not answer."""

    def __init__(self, address: str, api_key: str | None, timeout: float) -> None:
        self.address = address
        self.client = RuntimeClient(address, api_key=api_key, timeout=timeout)
        if not self.client.health(timeout=min(timeout, _CONNECT_TIMEOUT_S)):
            self.client.close()
            raise RuntimeUnavailableError(
                f"no sgl_lite runtime answers at {address} (start one with `sgl-lite serve` or sgl.Runtime())")

    def model_facts(self) -> dict[str, Any]:
        """model_path, chat_template, bos/eos tokens: the runtime's server_info holds them all."""
        info = self.client.server_info()
        return info.get("model_info", info)

    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        reply = self.client.generate(text=text, sampling_params=params.to_runtime_params(), **params.request_options())
        return reply.text, reply.meta_info

    def generate_stream(self, text: str, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        stream = self.client.generate_stream(text=text, sampling_params=params.to_runtime_params(),
                                             **params.request_options())
        for chunk in stream:
            yield chunk.text, chunk.meta_info

    def prefill(self, requests: list[PrefillRequest]) -> list[dict[str, Any]]:
        # All in flight at once, sent and awaited from this thread (no thread per choice, and no asyncio:
        # callers may be inside a running event loop).
        calls = [{"text": r.text, "input_ids": r.input_ids, "sampling_params": {"max_new_tokens": 0},
                  "return_logprob": r.return_logprob, "logprob_start_len": r.logprob_start_len} for r in requests]
        return [reply.meta_info for reply in self.client.generate_all(calls)]

    def flush_cache(self) -> bool:
        return self.client.flush_cache()

    def server_info(self) -> dict[str, Any]:
        return self.client.server_info()

    def close(self) -> None:
        self.client.close()
