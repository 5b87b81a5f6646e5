"""Any OpenAI-compatible server (vLLM, llama.cpp's llama-server, SGLang, sgl_lite's HTTP front) driven
over streaming `/v1/chat/completions`, so one workload compares them in one run.

The workload is token ids; a chat server takes text. Each request's ids are decoded with the model's
tokenizer and sent as one user message (the server applies its chat template); each turn's text extends
the previous turn's text, so a server's prefix cache sees the history as the shared prefix it is. With
chat_history="messages" a turn goes as the conversation an agent framework sends instead: the first
prompt and each observation as user messages, each answer as an assistant message, so that a server
whose cache keeps what it generated can reuse the answers too (the one-message form puts each answer
inside the next user message, where it is prefilled again). The
streamed text is re-encoded to ids with the same tokenizer: per chunk for the timings, and as the
output the next turn's prompt is built from. Token counts and cached tokens come from the server's
`usage` (stream_options.include_usage; `prompt_tokens_details.cached_tokens` where reported), else
from those re-encoded ids. Requests are greedy with `ignore_eos` (vLLM, llama-server, SGLang and
sgl_lite all accept it), so every system writes `max_tokens` tokens.

Before the run the prefix cache is flushed where the server offers a way (SGLang's `/flush_cache`,
vLLM's `/reset_prefix_cache` in its dev mode); otherwise the report says it was not.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, Sequence

import httpx2

from sgl_lite.bench.backends import StreamEvent
from sgl_lite.bench.chat_rendered import conversation
from sgl_lite.bench.config import CHAT_HISTORIES
from sgl_lite.bench.http_backend import FLUSH_ATTEMPTS, FLUSH_RETRY_S, HTTPBackend, HTTPStreamError

logger = logging.getLogger(__name__)

# POST endpoints that empty a server's prefix cache: SGLang and sgl_lite, then vLLM (dev mode only).
FLUSH_ENDPOINTS = ("/flush_cache", "/reset_prefix_cache")


class OpenAIChatBackend(HTTPBackend):
    """Streams `/v1/chat/completions` from `url`; `tokenizer` is the served model's (decode/encode)."""

    def __init__(self, name: str, url: str, tokenizer: Any, *, api_key: str | None = None,
                 chat_history: str = "one-message") -> None:
        super().__init__(name, url, api_key=api_key)
        if chat_history not in CHAT_HISTORIES:
            raise ValueError(f"chat_history must be one of {', '.join(CHAT_HISTORIES)}; got {chat_history!r}")
        self.tokenizer = tokenizer
        self.chat_history = chat_history
        self._model: str | None = None

    def _model_name(self) -> str:
        """The first model the server lists at /v1/models (what llama-server and vLLM expect in `model`)."""
        if self._model is None:
            with httpx2.Client(headers=self._headers, timeout=60.0) as client:
                response = client.get(self.url + "/v1/models")
            if response.status_code != 200:
                raise HTTPStreamError(f"{self.url}/v1/models answered {response.status_code}: {response.text[:300]}")
            models = response.json().get("data") or []
            if not models:
                raise HTTPStreamError(f"{self.url}/v1/models lists no model")
            self._model = str(models[0]["id"])
        return self._model

    async def stream(self, input_ids: list[int], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        async for event in self._stream_from(self.url, input_ids, max_new_tokens):
            yield event

    def stream_turn(self, pieces: Sequence[Sequence[int]], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        if self.chat_history == "messages":
            return self._stream_from(self.url, [t for piece in pieces for t in piece], max_new_tokens, pieces)
        return super().stream_turn(pieces, max_new_tokens)

    async def _stream_from(self, base_url: str, input_ids: list[int], max_new_tokens: int,
                           pieces: Sequence[Sequence[int]] | None = None) -> AsyncIterator[StreamEvent]:
        """`input_ids` as one user message, or its `pieces` as the conversation's messages."""
        body = {"model": self._model_name(), "messages": conversation(pieces or [input_ids], self.tokenizer),
                "max_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        endpoint = base_url + "/v1/chat/completions"
        usage: dict[str, Any] | None = None
        finish_reason: str | None = None
        count = 0
        async with self._async_client().stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise HTTPStreamError(f"{endpoint} answered {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise HTTPStreamError(f"{endpoint} stream error: {event['error']}")
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    finish_reason = choice.get("finish_reason") or finish_reason
                    text = (choice.get("delta") or {}).get("content") or ""
                    new_ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
                    if new_ids:
                        count += len(new_ids)
                        yield StreamEvent(time.perf_counter(), new_ids)
        if finish_reason is None:
            raise HTTPStreamError(f"{endpoint} stream ended without a finish_reason")
        usage = usage or {}
        meta = {"prompt_tokens": int(usage.get("prompt_tokens") or len(input_ids)),
                "completion_tokens": int(usage.get("completion_tokens") or count),
                "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                "finish_reason": {"type": finish_reason}}
        yield StreamEvent(time.perf_counter(), [], meta)

    def reset(self) -> None:
        status = 0
        with httpx2.Client(headers=self._headers, timeout=60.0) as client:
            for path in FLUSH_ENDPOINTS:
                for _ in range(FLUSH_ATTEMPTS):  # 400: requests still in flight (SGLang refuses then)
                    try:
                        status = client.post(self.url + path).status_code
                    except httpx2.HTTPError:
                        break
                    if status != 400:
                        break
                    time.sleep(FLUSH_RETRY_S)
                if status == 200:
                    self.latency_note = ""
                    return
        self.latency_note = "prefix cache not flushed before the run (the server offers no flush endpoint)"
        logger.warning("%s: %s", self.name, self.latency_note)
