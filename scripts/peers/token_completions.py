"""One streamed OpenAI completion whose prompt and output are token ids: `POST /v1/completions` with `prompt`
a list of ids, greedy, `ignore_eos`, and `return_token_ids` (vLLM's extension: each streamed chunk carries its
new tokens' ids). A benchmark sends a peer exactly the tokens it sends sgl_lite this way, whatever the
tokenizer would make of them as text, and times the first token as the client sees it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

MAX_PROMPT_TOKENS = 1_000_000
MAX_OUTPUT_TOKENS = 65_536
MAX_RESPONSE_BYTES = 64 * 2**20  # a stream longer than this is not a completion of the sizes above


class CompletionError(RuntimeError):
    """The server refused the request or answered with something that is not a token-id completion."""


@dataclass
class Completion:
    """What one streamed completion gave: its output token ids, the seconds to the first chunk that held a
    token, and to the end of the stream."""

    output: list[int]
    ttft_s: float
    e2e_s: float


def completion_body(model: str, prompt: Sequence[int], max_tokens: int) -> dict:
    """The request body: `prompt` as token ids, exactly `max_tokens` greedy tokens, streamed with their ids."""
    if not 0 < len(prompt) <= MAX_PROMPT_TOKENS:
        raise ValueError(f"prompt must hold 1 to {MAX_PROMPT_TOKENS} token ids, not {len(prompt)}")
    bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or t < 0]
    if bad:
        raise ValueError(f"prompt token ids must be non-negative integers; got {bad[:3]!r}")
    if not 0 < max_tokens <= MAX_OUTPUT_TOKENS:
        raise ValueError(f"max_tokens must be 1 to {MAX_OUTPUT_TOKENS}, not {max_tokens}")
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


def served_model(url: str, timeout: float = 30) -> str:
    """The first model `GET {url}/v1/models` lists: the name completions must ask for."""
    with urllib.request.urlopen(url + "/v1/models", timeout=timeout) as response:
        models = json.loads(response.read(MAX_RESPONSE_BYTES)).get("data") or []
    if not models:
        raise CompletionError(f"{url}/v1/models lists no model")
    return models[0]["id"]


def stream_completion(url: str, model: str, prompt: Sequence[int], max_tokens: int,
                      timeout: float = 3600) -> Completion:
    """Send one completion to `url` and read its stream to the end (`data: [DONE]`)."""
    request = urllib.request.Request(url + "/v1/completions", method="POST",
                                     data=json.dumps(completion_body(model, prompt, max_tokens)).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft, output, read = None, [], 0
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for line in response:
                read += len(line)
                if read > MAX_RESPONSE_BYTES:
                    raise CompletionError(f"the stream from {url} ran past {MAX_RESPONSE_BYTES} bytes")
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise CompletionError(f"{url} failed the completion: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids")
                    if ids is None and choice.get("text"):
                        raise CompletionError(f"{url} streams text without token ids: it does not take return_token_ids")
                    if ids and ttft is None:
                        ttft = time.perf_counter() - start
                    output += ids or []
    except urllib.error.HTTPError as e:
        raise CompletionError(f"{url} answered {e.code}: {e.read(2000).decode(errors='replace')}") from e
    if len(output) != max_tokens or ttft is None:
        raise CompletionError(f"{url} streamed {len(output)} token ids, not the {max_tokens} asked for")
    return Completion(output, ttft, time.perf_counter() - start)
