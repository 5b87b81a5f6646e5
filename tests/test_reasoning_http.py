"""--reasoning-parser qwen3 over HTTP (tiny random model): the model's `<think>` block is `reasoning_content` on
chat completions, whole and streamed, and the text is the same the server writes with separate_reasoning off.
A random model never thinks by itself, so a regex makes it write a think block (a grammar from the first
token: the output then starts outside the reasoning, and its `<think>` opens it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx2
import pytest
from test_http import API_KEY, Live

from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(300)

THINKING = "<think>[a-z]{2,6}</think>[a-z]{1,4}"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "regex": THINKING,
        "temperature": 0.0, "max_tokens": 40}


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path) -> Iterator[Live]:
    runtime = Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, random_seed=0, dtype="float32",
                      reasoning_parser="qwen3")
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), api_key=API_KEY, served_model_name="tiny"))
    try:
        yield Live(runtime, http, None)
    finally:
        http.stop()
        runtime.shutdown()


def _chat(live: Live, **change: Any) -> dict[str, Any]:
    response = live.post("/v1/chat/completions", {**BODY, **change})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_the_think_block_is_reasoning_content(live: Live) -> None:
    raw = _chat(live, separate_reasoning=False)["message"]
    assert "reasoning_content" not in raw and raw["content"].startswith("<think>")
    reasoning, answer = raw["content"][len("<think>"):].split("</think>")
    message = _chat(live)["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, answer)
    assert reasoning and answer
    assert_idle_without_leaks(live.client)


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_streamed_reasoning_joins_to_the_whole(live: Live, stream_reasoning: bool) -> None:
    whole = _chat(live)["message"]
    body = {**BODY, "stream": True, "stream_reasoning": stream_reasoning}
    with httpx2.stream("POST", live.http.url + "/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert "".join(reasoning) == whole["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    if not stream_reasoning:
        assert len(reasoning) == 1  # at once, when it ended


def _tokens_through_think_end(content: list[dict[str, Any]]) -> int:
    """How many output tokens it takes, by their logprob bytes, to write the closing `</think>`."""
    written = b""
    for count, entry in enumerate(content, 1):
        written += bytes(entry["bytes"])
        if b"</think>" in written:
            return count
    raise AssertionError(f"no </think> in {written!r}")


def test_chat_usage_counts_the_reasoning_tokens(live: Live) -> None:
    response = live.post("/v1/chat/completions", {**BODY, "logprobs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = _tokens_through_think_end(body["choices"][0]["logprobs"]["content"])
    assert 0 < expected < body["usage"]["completion_tokens"]  # an answer follows the think block
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}
    stream = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    with httpx2.stream("POST", live.http.url + "/v1/chat/completions", json=stream,
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as reply:
        events = [json.loads(line[len("data: "):]) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}
    plain = live.post("/v1/chat/completions", {**BODY, "separate_reasoning": False}).json()
    assert "completion_tokens_details" not in plain["usage"]  # no reasoning split, nothing counted
    assert_idle_without_leaks(live.client)


def test_responses_usage_counts_the_reasoning_tokens(live: Live) -> None:
    body = {"model": "tiny", "input": "What is 2 + 3?", "temperature": 0.0, "max_output_tokens": 8}
    # qwen3 thinks unless told not to: a random model's output never closes the block, so all of it is reasoning.
    thinking = live.post("/v1/responses", body).json()
    assert [item["type"] for item in thinking["output"]] == ["reasoning"]
    usage = thinking["usage"]
    assert usage["output_tokens"] == 8 and usage["output_tokens_details"] == {"reasoning_tokens": 8}
    # A format constrains the output from its first token: no reasoning.
    schema = {"type": "json_schema", "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    answer = live.post("/v1/responses", {**body, "text": {"format": schema}}).json()
    assert answer["usage"]["output_tokens"] > 0 and answer["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    assert_idle_without_leaks(live.client)
