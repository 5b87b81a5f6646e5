"""RuntimeEndpoint: the frontend backend that talks to a runtime server over ZeroMQ.

It takes the server's HTTP URL, as SGLang's does (`http://host:30000`, the server's --port), and finds
the ZeroMQ endpoint from it (/server_info names it); or the ZeroMQ address itself (tcp://, ipc://).
One RuntimeClient (thread-safe; one I/O thread) serves every program thread. Prefill-only
batches (select scoring) are sent concurrently so the runtime can put them in one batch.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from sgl_lite.lang.backend.base import BaseBackend, PrefillRequest
from sgl_lite.lang.chat_template import CHATML, LLAMA3, ChatTemplate, chat_template_from_model_info
from sgl_lite.lang.ir import SglSamplingParams
from sgl_lite.runtime.client import RuntimeClient, RuntimeUnavailableError
from sgl_lite.runtime.client.discovery import discover_zmq_address

_NAMED_TEMPLATES = {"chatml": CHATML, "llama-3-instruct": LLAMA3}
_CONNECT_TIMEOUT_S = 10.0


class RuntimeEndpoint(BaseBackend):
    def __init__(self, base_url: str, api_key: Optional[str] = None, chat_template_name: Optional[str] = None,
                 timeout: float = 600.0) -> None:
        self.base_url = base_url
        self.api_key = api_key
        connect_timeout = min(timeout, _CONNECT_TIMEOUT_S)
        if base_url.startswith(("http://", "https://")):
            self.address = discover_zmq_address(base_url, api_key, timeout=connect_timeout)
        else:
            self.address = base_url
        self.client = RuntimeClient(self.address, api_key=api_key, timeout=timeout)
        if not self.client.health(timeout=connect_timeout):
            self.client.close()
            raise RuntimeUnavailableError(
                f"no sgl_lite runtime answers at {self.address} (start one with `sgl-lite serve` or sgl.Runtime())")
        self.model_info = self.client.server_info()
        if chat_template_name is not None:
            if chat_template_name not in _NAMED_TEMPLATES:
                raise ValueError(f"chat_template_name must be one of {', '.join(_NAMED_TEMPLATES)}; "
                                 f"got {chat_template_name!r}")
            self.chat_template = _NAMED_TEMPLATES[chat_template_name]
        else:
            info = self.model_info.get("model_info", self.model_info)
            self.chat_template = chat_template_from_model_info(info)

    def get_model_name(self) -> str:
        info = self.model_info.get("model_info", self.model_info)
        return str(info.get("model_path", ""))

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    @staticmethod
    def _options(params: SglSamplingParams) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if params.return_logprob:
            options["return_logprob"] = True
            if params.logprob_start_len is not None:
                options["logprob_start_len"] = params.logprob_start_len
            if params.top_logprobs_num is not None:
                options["top_logprobs_num"] = params.top_logprobs_num
        if params.priority is not None:
            options["priority"] = params.priority
        return options

    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        reply = self.client.generate(text=text, sampling_params=params.to_runtime_params(), **self._options(params))
        return reply.text, reply.meta_info

    def generate_stream(self, text: str, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        stream = self.client.generate_stream(text=text, sampling_params=params.to_runtime_params(),
                                             **self._options(params))
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

    def get_server_info(self) -> dict[str, Any]:
        return self.client.server_info()

    def close(self) -> None:
        self.client.close()
