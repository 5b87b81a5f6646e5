"""/tokenize, /detokenize (vLLM's shapes) and /abort_request (SGLang's) against a live runtime (tiny random
model). Expected ids come from transformers' own tokenizer and chat template, and a chat's count from the
usage the chat completion itself reports."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx2
import pytest
from transformers import AutoTokenizer

from sgl_lite.http.app import create_app
from sgl_lite.http.guards.limits import HttpLimits
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(180)

API_KEY = "tok-key"
ADMIN_KEY = "tok-admin-key"  # abort_all needs it (--admin-api-key)
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
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), api_key=API_KEY, admin_api_key=ADMIN_KEY,
                                       served_model_name="tiny", limits=HttpLimits(max_chat_messages=4)))
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


def test_a_list_of_prompts_is_answered_with_a_list_per_field(live):
    """SGLang's list form: tokens, count and token_strs each a list, one entry per prompt, in order."""
    texts = ["First prompt.", "A second, longer prompt with more words in it.", "3"]
    body = live.post("/v1/tokenize", {"prompt": texts, "return_token_strs": True}).json()
    want = [live.tokenizer(text).input_ids for text in texts]
    assert body["tokens"] == want and body["count"] == [len(ids) for ids in want]
    assert body["token_strs"] == [live.tokenizer.convert_ids_to_tokens(ids) for ids in want]
    assert isinstance(body["max_model_len"], int)
    one = live.post("/v1/tokenize", {"prompt": texts[:1]}).json()  # a list of one stays a list
    assert one["tokens"] == want[:1] and one["count"] == [len(want[0])]


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
    ("/tokenize", {"prompt": []}, "prompt"),
    ("/tokenize", {"prompt": ["x"] * 4097}, "prompt"),
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


LONG_RUN = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}


def _in_background(live: Live, path: str, body: dict[str, Any], results: dict[str, Any], name: str) -> threading.Thread:
    """POST in a thread; results[name] is the response, or for a stream its `data:` events."""
    def run() -> None:
        if not body.get("stream"):
            results[name] = live.post(path, body)
            return
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx2.stream("POST", live.http.url + path, json=body, headers=headers, timeout=60) as response:
            results[name] = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _generate_in_background(live: Live, rid: str, results: dict[str, Any], stream: bool = False) -> threading.Thread:
    body = {"text": "Count forever:", "rid": rid, "sampling_params": LONG_RUN, "stream": stream}
    return _in_background(live, "/generate", body, results, rid)


def _abort_until(live: Live, body: dict[str, Any], expect: int) -> None:
    """Post `body` until it has aborted `expect` requests in all (they start at their threads' pace); abort_all
    with the admin key (a caller's own key aborts only its own requests: test_hostile_round3.py)."""
    deadline = time.monotonic() + 30
    total = 0
    key = ADMIN_KEY if body.get("abort_all") else API_KEY
    while total < expect:
        assert time.monotonic() < deadline, f"aborted {total} of {expect}"
        total += live.post("/abort_request", body, key=key).json()["aborted"]
        time.sleep(0.02)
    assert total == expect


def _assert_greedy_prefix(live: Live, result: dict[str, Any]) -> None:
    """An aborted /generate answer: the output so far, which a greedy run of that length reproduces."""
    meta = result["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "aborted by the client"}
    ids = result["output_ids"]
    assert 0 < len(ids) < LONG_RUN["max_new_tokens"] and meta["completion_tokens"] == len(ids)
    again = live.post("/generate", {"text": "Count forever:", "sampling_params": {**LONG_RUN, "max_new_tokens": len(ids)}})
    assert again.json()["output_ids"] == ids and again.json()["text"] == result["text"]


def _wait_for_output(live: Live, requests: int = 1) -> None:
    """Until `requests` requests are running and have each produced a few tokens (so that an abort has
    output to answer with)."""
    deadline = time.monotonic() + 30
    while True:
        info = live.runtime.client.server_info()
        if info["num_running"] >= requests:
            break
        assert time.monotonic() < deadline, "nothing started running"
        time.sleep(0.02)
    generated = info["generated_tokens_total"]
    while live.runtime.client.server_info()["generated_tokens_total"] < generated + 2 * requests:
        assert time.monotonic() < deadline, "no tokens came out"
        time.sleep(0.02)


def test_abort_request_answers_a_generate_with_its_output_so_far(live):
    assert live.post("/abort_request", {"rid": "nobody-runs-this"}).json() == {"aborted": 0}
    results: dict[str, Any] = {}
    thread = _generate_in_background(live, "long-1", results)
    _wait_for_output(live)
    _abort_until(live, {"rid": "long-1"}, 1)
    thread.join(30)
    reply = results["long-1"]
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["id"] == "long-1"
    _assert_greedy_prefix(live, reply.json())
    assert_idle_without_leaks(live.runtime.client)


def test_an_aborted_stream_ends_with_finish_reason_abort(live):
    results: dict[str, Any] = {}
    thread = _generate_in_background(live, "long-stream", results, stream=True)
    _wait_for_output(live)
    _abort_until(live, {"rid": "long-stream"}, 1)
    thread.join(30)
    events = results["long-stream"]
    assert events[-1] == "[DONE]" and len(events) >= 2
    last = json.loads(events[-2])
    assert all(json.loads(e)["meta_info"].get("finish_reason") is None for e in events[:-2])
    _assert_greedy_prefix(live, last)


def test_abort_all_ends_every_running_generate(live):
    results: dict[str, Any] = {}
    threads = [_generate_in_background(live, f"many-{i}", results) for i in range(3)]
    _wait_for_output(live, 3)
    _abort_until(live, {"abort_all": True}, 3)
    for thread in threads:
        thread.join(30)
    assert sorted(results) == ["many-0", "many-1", "many-2"]
    for reply in results.values():
        assert reply.status_code == 200 and reply.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert_idle_without_leaks(live.runtime.client)


def test_an_aborted_batch_entry_leaves_the_others_running(live):
    results: dict[str, Any] = {}
    short = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
    body = {"text": ["Count forever:", "Count to three:"], "rid": ["batch-long", "batch-short"],
            "sampling_params": [LONG_RUN, short]}
    thread = _in_background(live, "/generate", body, results, "batch")
    _wait_for_output(live)
    _abort_until(live, {"rid": "batch-long"}, 1)
    thread.join(30)
    long_one, short_one = results["batch"].json()
    _assert_greedy_prefix(live, long_one)
    assert short_one["meta_info"]["finish_reason"]["type"] == "length" and len(short_one["output_ids"]) == 6
    assert_idle_without_leaks(live.runtime.client)


def test_an_aborted_chat_completion_says_abort(live):
    results: dict[str, Any] = {}
    body = {"model": "tiny", "messages": CHAT[:1] + [{"role": "user", "content": "Count forever."}],
            "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    thread = _in_background(live, "/v1/chat/completions", body, results, "chat")
    _wait_for_output(live)
    _abort_until(live, {"abort_all": True}, 1)
    thread.join(30)
    reply = results["chat"]
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < reply.json()["usage"]["completion_tokens"] < 1500
    assert_idle_without_leaks(live.runtime.client)
