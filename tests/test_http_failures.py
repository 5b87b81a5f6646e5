"""The HTTP front when the runtime fails: a dead runtime (500, unhealthy), a full queue (503) and a mid-stream abort."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_client import FakeRouter

from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.runtime.client import RuntimeClient

pytestmark = pytest.mark.timeout(180)


def test_dead_runtime_gives_500_and_unhealthy(tmp_path: Path) -> None:
    dead = RuntimeClient(f"ipc://{tmp_path}/nobody-listens", timeout=5, health_interval=0.2, health_timeout=0.5)
    http = HttpServerThread(create_app(dead, served_model_name="gone"))
    try:
        response = httpx2.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert response.status_code == 500
        assert "runtime" in response.json()["error"]["message"]
        assert httpx2.get(http.url + "/health", timeout=30).status_code == 503
    finally:
        http.stop()
        dead.close()


def scripted_runtime(answer: Any) -> FakeRouter:
    """A ZeroMQ ROUTER speaking the runtime protocol with canned generate answers, for outcomes a
    live tiny runtime cannot be driven into on demand (a full queue, an abort mid-stream)."""
    from sgl_lite.runtime import protocol

    def handler(msg: protocol.Request) -> list[Any]:
        if isinstance(msg, protocol.GenerateReq):
            return answer(msg)
        if isinstance(msg, protocol.ServerInfoReq):
            return [protocol.InfoReply(msg.rid, {"model_path": None, "served_model_name": "scripted",
                                                 "chat_template": "{{ messages[0]['content'] }}"})]
        return [protocol.InfoReply(msg.rid, {"ok": True})]

    return FakeRouter(handler)


def test_full_queue_gets_503_and_a_mid_stream_abort_an_error_event() -> None:
    from sgl_lite.runtime import protocol

    def answer(msg: protocol.GenerateReq) -> list[Any]:
        if msg.text == "busy":
            return [protocol.ErrorReply(msg.rid, "the waiting queue is full (1 requests)", "queue_full")]
        return [protocol.TokenChunk(msg.rid, "partial", [1], {"prompt_tokens": 1, "completion_tokens": 1}),
                protocol.ErrorReply(msg.rid, "retracted too often", "aborted")]

    scripted = scripted_runtime(answer)
    client = RuntimeClient(scripted.address, timeout=10)
    http = HttpServerThread(create_app(client))
    try:
        busy = httpx2.post(http.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "busy"}]})
        assert busy.status_code == 503
        assert busy.json()["error"]["code"] == "queue_full" and "queue is full" in busy.json()["error"]["message"]
        with httpx2.stream("POST", http.url + "/v1/completions", json={"prompt": "go", "stream": True}) as response:
            assert response.status_code == 200
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[0])["choices"][0]["text"] == "partial"
        assert json.loads(events[1])["error"]["message"] == "retracted too often"
        assert events[2:] == ["[DONE]"]
        scrape = httpx2.get(http.url + "/metrics").text
        outcomes = {(s.labels["endpoint"], s.labels["outcome"]): s.value
                    for family in text_string_to_metric_families(scrape) for s in family.samples
                    if s.name == "sgl_lite_http_requests_total"}
        assert outcomes == {("/v1/chat/completions", "queue_full"): 1, ("/v1/completions", "aborted"): 1}
    finally:
        http.stop()
        client.close()
        scripted.close()
