"""The prompts of one request together (a /generate batch, a /v1/completions list prompt) are bounded by
what one request may prefill (guards/prompt_budget.py): --max-prefill-tokens-per-request when set, else
max(--max-prefill-tokens, the context length). Over it: a 400 naming the limit and the count, before any
prompt reaches the runtime; under it: served. The front is tested over a scripted runtime (which records
what reaches it), then once over a live tiny runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx2
import pytest
from test_client import FakeRouter
from transformers import AutoTokenizer

from sgl_lite.http.app import create_app
from sgl_lite.http.guards.prompt_budget import BatchTokenLimit
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

CONTEXT = 64
PREFILL = 128  # the batch limit: max(PREFILL, CONTEXT)


class Front:
    """An HTTP front over a scripted runtime that answers every generate with one token."""

    def __init__(self, model_dir: Path, server_args: dict[str, Any]) -> None:
        def handler(msg: protocol.Request) -> list[Any]:
            if isinstance(msg, protocol.GenerateReq):
                meta = {"prompt_tokens": 1, "completion_tokens": 1, "finish_reason": {"type": "length", "length": 1}}
                return [protocol.Finished(msg.rid, "ok", [1], meta)]
            if isinstance(msg, protocol.ServerInfoReq):
                return [protocol.InfoReply(msg.rid, {"model_path": str(model_dir), "served_model_name": "scripted",
                                                     "context_length": CONTEXT, "server_args": server_args})]
            return [protocol.InfoReply(msg.rid, {"ok": True})]

        self.runtime = FakeRouter(handler)
        self.client = RuntimeClient(self.runtime.address, timeout=30)
        self.http = HttpServerThread(create_app(self.client))

    def post(self, path: str, body: dict[str, Any]) -> httpx2.Response:
        return httpx2.post(self.http.url + path, json=body, timeout=60)

    def generates_received(self) -> int:
        return sum(isinstance(m, protocol.GenerateReq) for m in self.runtime.received)

    def close(self) -> None:
        self.http.stop()
        self.client.close()
        self.runtime.close()


@pytest.fixture
def front(tiny_llama_dir: Path) -> Iterator[Front]:
    f = Front(tiny_llama_dir, {"max_prefill_tokens": PREFILL, "max_prefill_tokens_per_request": None})
    yield f
    f.close()


def _refusal(response: httpx2.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_the_limit_comes_from_the_servers_flags() -> None:
    assert BatchTokenLimit.of_server({"max_prefill_tokens": 16384}, 8192).tokens == 16384
    assert BatchTokenLimit.of_server({"max_prefill_tokens": 16384}, 131072).tokens == 131072
    per_request = BatchTokenLimit.of_server({"max_prefill_tokens": 16384, "max_prefill_tokens_per_request": 4096}, 8192)
    assert per_request is not None and per_request.tokens == 4096
    assert "--max-prefill-tokens-per-request 4096" in per_request.source
    assert BatchTokenLimit.of_server({}, 8192) is None  # a runtime that does not say: no bound


def test_a_generate_batch_of_ids_under_the_limit_is_served_and_one_over_it_refused(front: Front) -> None:
    served = front.post("/generate", {"input_ids": [[5] * 60, [6] * 60], "sampling_params": {"max_new_tokens": 1}})
    assert served.status_code == 200 and len(served.json()) == 2
    assert front.generates_received() == 2
    error = _refusal(front.post("/generate", {"input_ids": [[5] * 60, [6] * 60, [7] * 10]}))
    assert error["param"] == "input_ids"
    assert "130 tokens" in error["message"] and f"--max-prefill-tokens {PREFILL}" in error["message"]
    assert front.generates_received() == 2  # nothing of the refused batch reached the runtime
    again = front.post("/generate", {"input_ids": [[5] * 60, [6] * 60]})
    assert again.status_code == 200 and front.generates_received() == 4


def test_a_text_batch_is_counted_as_the_runtime_tokenizes_it(front: Front, tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))  # the runtime's own tokenizer call
    text = "the quick brown fox jumps over the lazy dog " * 4
    per_text = len(tokenizer(text)["input_ids"])
    count = PREFILL // per_text + 1  # just over the limit
    assert per_text * (count - 1) <= PREFILL < per_text * count
    error = _refusal(front.post("/generate", {"text": [text] * count}))
    assert error["param"] == "text" and f"{per_text * count} tokens" in error["message"]
    assert front.generates_received() == 0
    served = front.post("/generate", {"text": [text] * (count - 1)})
    assert served.status_code == 200 and len(served.json()) == count - 1


def test_text_that_cannot_fit_is_refused_by_its_characters(front: Front, tiny_llama_dir: Path) -> None:
    longest = max(map(len, AutoTokenizer.from_pretrained(str(tiny_llama_dir)).get_vocab()))
    half = "x" * (PREFILL * longest // 2 + 1)
    error = _refusal(front.post("/generate", {"text": [half, half]}))
    assert "characters" in error["message"] and str(2 * len(half)) in error["message"]
    assert front.generates_received() == 0


def test_samples_of_one_prompt_count_once(front: Front) -> None:
    body = {"input_ids": [[5] * 60, [6] * 60], "sampling_params": {"max_new_tokens": 1, "n": 3}}
    assert front.post("/generate", body).status_code == 200
    assert front.generates_received() == 6


def test_completions_with_a_list_prompt_have_the_same_limit(front: Front) -> None:
    error = _refusal(front.post("/v1/completions", {"prompt": [[5] * 60, [6] * 60, [7] * 10], "max_tokens": 1}))
    assert error["param"] == "prompt" and "130 tokens" in error["message"]
    assert front.generates_received() == 0
    served = front.post("/v1/completions", {"prompt": [[5] * 60, [6] * 60], "max_tokens": 1})
    assert served.status_code == 200 and len(served.json()["choices"]) == 2


def test_the_per_request_flag_bounds_a_batch_as_one_request(tiny_llama_dir: Path) -> None:
    front = Front(tiny_llama_dir, {"max_prefill_tokens": PREFILL, "max_prefill_tokens_per_request": 100})
    try:
        error = _refusal(front.post("/generate", {"input_ids": [[5] * 60, [6] * 60]}))
        assert "120 tokens" in error["message"] and "--max-prefill-tokens-per-request 100" in error["message"]
        assert front.post("/generate", {"input_ids": [[5] * 50, [6] * 50]}).status_code == 200
    finally:
        front.close()


def test_a_live_server_refuses_an_over_limit_batch_and_keeps_serving(tiny_llama_dir: Path) -> None:
    with Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, dtype="float32", context_length=CONTEXT,
                 max_prefill_tokens=PREFILL) as runtime:
        over = httpx2.post(runtime.url + "/generate", json={"input_ids": [[5] * 50] * 3}, timeout=60)
        assert "150 tokens" in _refusal(over)["message"]
        under = httpx2.post(runtime.url + "/generate", timeout=60,
                            json={"input_ids": [[5] * 50, [6] * 50], "sampling_params": {"max_new_tokens": 2}})
        assert under.status_code == 200
        assert [r["meta_info"]["prompt_tokens"] for r in under.json()] == [50, 50]
        assert_idle_without_leaks(runtime.client)
