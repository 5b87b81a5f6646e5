"""/tokenize, /detokenize (vLLM's shapes) and /abort_request (SGLang's) against a live runtime (tiny random
model). Expected ids come from transformers' own tokenizer and chat template, and a chat's count from the
usage the chat completion itself reports."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx2
import pytest
from transformers import AutoTokenizer

from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.http.limits import HttpLimits
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(180)

API_KEY = "tok-key"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]


class Live:
    def __init__(self, runtime: Runtime, http: HttpServerThread, tokenizer: Any) -> None:
        self.runtime, self.http, self.tokenizer = runtime, http, tokenizer

    def post(self, path: str, body: Any, key: str | None = API_KEY) -> httpx2.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx2.post(self.http.url + path, json=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path) -> Iterator[Live]:
    runtime = Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, dtype="float32")
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), api_key=API_KEY,
                                       limits=HttpLimits(max_chat_messages=4)))
    try:
        yield Live(runtime, http, AutoTokenizer.from_pretrained(tiny_llama_dir))
    finally:
        http.stop()
        runtime.shutdown()


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_a_prompt_tokenizes_as_transformers_does(live, path):
    text = "Tokenize me, then count: one two three."
    for add_special_tokens in (True, False):
        reply = live.post(path, {"prompt": text, "add_special_tokens": add_special_tokens, "return_token_strs": True})
        assert reply.status_code == 200, reply.text
        want = live.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        body = reply.json()
        assert body["tokens"] == want and body["count"] == len(want)
        assert body["token_strs"] == live.tokenizer.convert_ids_to_tokens(want)
        assert body["max_model_len"] == live.runtime.client.server_info()["context_length"]
    default = live.post(path, {"prompt": text}).json()["tokens"]
    assert default == live.tokenizer(text).input_ids  # special tokens added unless asked otherwise


def test_a_chat_counts_what_its_completion_reports(live):
    reply = live.post("/tokenize", {"messages": CHAT})
    assert reply.status_code == 200, reply.text
    ids = reply.json()["tokens"]
    assert ids == live.tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
    completion = live.post("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 1})
    assert completion.status_code == 200, completion.text
    assert reply.json()["count"] == completion.json()["usage"]["prompt_tokens"]
    without = live.post("/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert without == live.tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=False, return_dict=False)


def test_detokenize_inverts_tokenize(live):
    ids = live.tokenizer("Round trip, with punctuation!").input_ids
    reply = live.post("/detokenize", {"tokens": ids})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": live.tokenizer.decode(ids)}
    chat = live.tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    for skip in (False, True):
        reply = live.post("/detokenize", {"tokens": chat, "skip_special_tokens": skip})
        assert reply.json() == {"prompt": live.tokenizer.decode(chat, skip_special_tokens=skip)}
    assert live.tokenizer.decode(chat, skip_special_tokens=True) != live.tokenizer.decode(chat)  # the case is live


@pytest.mark.parametrize(("path", "body", "says"), [
    ("/tokenize", {}, "exactly one of prompt and messages"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "exactly one of prompt and messages"),
    ("/tokenize", {"messages": CHAT * 3}, "--max-chat-messages 4"),
    ("/tokenize", {"prompt": "x", "temperature": 0}, "temperature"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1] = 1000000000"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0] = -1"),
    ("/abort_request", {"rid": "x" * 10_000}, "rid"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "description": "d" * 70_000}}}}}]}, "tools[0]"),
])
def test_bad_input_gets_a_400_naming_it(live, path, body, says):
    reply = live.post(path, body)
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/abort_request"])
def test_the_routes_need_the_key(live, path):
    assert live.post(path, {"prompt": "x", "tokens": [1]}, key=None).status_code == 401


def _generate_in_background(live: Live, rid: str, results: dict[str, httpx2.Response]) -> threading.Thread:
    body = {"text": "Count forever:", "rid": rid,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}}
    thread = threading.Thread(target=lambda: results.__setitem__(rid, live.post("/generate", body)))
    thread.start()
    return thread


def _abort_until(live: Live, body: dict[str, Any], expect: int) -> None:
    """Post `body` until it has aborted `expect` requests in all (they start at their threads' pace)."""
    deadline = time.monotonic() + 30
    total = 0
    while total < expect:
        assert time.monotonic() < deadline, f"aborted {total} of {expect}"
        total += live.post("/abort_request", body).json()["aborted"]
        time.sleep(0.02)
    assert total == expect


def test_abort_request_ends_a_generate_by_its_rid_and_frees_its_slots(live):
    assert live.post("/abort_request", {"rid": "nobody-runs-this"}).json() == {"aborted": 0}
    results: dict[str, httpx2.Response] = {}
    thread = _generate_in_background(live, "long-1", results)
    _abort_until(live, {"rid": "long-1"}, 1)
    thread.join(30)
    reply = results["long-1"]
    assert reply.status_code == 500 and "aborted" in reply.json()["error"]["message"]
    assert_idle_without_leaks(live.runtime.client)


def test_abort_all_ends_every_running_generate(live):
    results: dict[str, httpx2.Response] = {}
    threads = [_generate_in_background(live, f"many-{i}", results) for i in range(3)]
    _abort_until(live, {"abort_all": True}, 3)
    for thread in threads:
        thread.join(30)
    assert sorted(results) == ["many-0", "many-1", "many-2"]
    assert all(r.status_code == 500 and "aborted" in r.json()["error"]["message"] for r in results.values())
    assert_idle_without_leaks(live.runtime.client)
