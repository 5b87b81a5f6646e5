"""The request surface over HTTP (tiny random model): SGLang's frontend's /generate bodies, each honoured
field's effect, strict types, the OpenAI routes' model name, chat rendering options, and the access log.

One runtime (`sgl-lite serve` through sgl.Runtime, with --log-requests and a chat template that reads
enable_thinking and reasoning_effort) serves the module; most tests go through an in-process front over
it (API key on, served name "tiny"), the access-log-in-serve test through serve's own front. Expected
outputs come from the runtime itself through RuntimeClient, and prompts from transformers.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator

import httpx2
import pytest
from test_request_fields import THINKING_TEMPLATE
from transformers import AutoTokenizer
from waiting import wait_until

from sgl_lite.http.app import create_app
from sgl_lite.http.guards.access_log import LOGGED_BODY_CHARS
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient

pytestmark = pytest.mark.timeout(240)

API_KEY = "fields-key"
GREEDY = {"temperature": 0.0}


class Live:
    def __init__(self, runtime: Runtime, http: HttpServerThread, tokenizer: Any) -> None:
        self.runtime, self.http, self.tokenizer = runtime, http, tokenizer
        self.client = runtime.client

    def post(self, path: str, body: Any, url: str | None = None, **headers: str) -> httpx2.Response:
        return httpx2.post((url or self.http.url) + path, json=body, timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}", **headers})

    def generate(self, body: dict[str, Any]) -> Any:
        response = self.post("/generate", body)
        assert response.status_code == 200, response.text
        return response.json()

    def chat_ids(self, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, chat_template=THINKING_TEMPLATE, tokenize=False, **kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    runtime = Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, random_seed=0, dtype="float32",
                      chat_template=str(template), log_requests=True)
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), api_key=API_KEY, served_model_name="tiny"))
    try:
        yield Live(runtime, http, AutoTokenizer.from_pretrained(tiny_llama_dir))
    finally:
        http.stop()
        runtime.shutdown()


# ---------------------------------------------------------------- /generate


def test_sglang_frontend_bodies_are_served(live: Live) -> None:
    """The bodies SGLang 0.5.23's RuntimeEndpoint sends for gen (plain and streamed) and select."""
    sampling = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 6,
                "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0,
                "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                "ignore_eos": False, "regex": None, "json_schema": None}
    expected = live.client.generate("Q: hi\nA:", sampling_params={"max_new_tokens": 6, **GREEDY})
    plain = live.generate({"text": "Q: hi\nA:", "sampling_params": sampling, "return_logprob": False})
    assert plain["text"] == expected.text
    with httpx2.stream("POST", live.http.url + "/generate", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"text": "Q: hi\nA:", "sampling_params": sampling, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and expected.text in lines[-2]
    scored = live.generate({"text": ["Q: hi\nA: yes", "Q: hi\nA: no"], "sampling_params": {"max_new_tokens": 0,
                            "temperature": 0}, "return_logprob": True, "return_text_in_logprobs": True,
                            "logprob_start_len": 3})
    assert all(isinstance(entry[2], str) for item in scored for entry in item["meta_info"]["input_token_logprobs"])


def test_unknown_fields_and_loose_types_are_refused_with_the_field_named(live: Live) -> None:
    for body, field in [({"text": "x", "colour": "red"}, "colour"),
                        ({"text": "x", "sampling_params": {"tempurature": 0.5}}, "tempurature"),
                        ({"input_ids": ["1", "2"]}, "input_ids"),
                        ({"text": "x", "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
                        ({"text": "x", "sampling_params": {"stop_regex": "(a+"}}, "stop_regex"),
                        ({"text": "x", "image_data": "cat.png"}, "image_data")]:
        response = live.post("/generate", body)
        assert response.status_code == 400 and field in response.json()["error"]["message"], (body, response.text)


def test_no_logs_is_refused_while_requests_are_logged(live: Live) -> None:
    # The module's runtime runs with --log-requests: its log would hold the text no_logs asks to keep out.
    refused = live.post("/generate", {"text": "secret", "no_logs": True, "sampling_params": {"max_new_tokens": 1}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "no_logs"
    assert live.post("/generate", {"text": "public", "no_logs": False, "sampling_params": {"max_new_tokens": 1}}).is_success


def test_stop_token_ids_and_min_new_tokens(live: Live) -> None:
    free = live.generate({"text": "a b c d", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, **GREEDY}})
    first = free["output_ids"][0]
    stopped = live.generate({"text": "a b c d", "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [first],
                                                                    **GREEDY}})
    assert stopped["output_ids"] == [first] and stopped["meta_info"]["finish_reason"]["matched"] == first
    held = live.generate({"text": "a b c d", "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [first],
                                                                 "min_new_tokens": 3, **GREEDY}})
    assert len(held["output_ids"]) >= 3 and first not in held["output_ids"][:3]  # masked until then, as SGLang does


def test_min_p_repetition_penalty_and_sampling_seed(live: Live) -> None:
    base = {"max_new_tokens": 16, "ignore_eos": True}
    greedy = live.generate({"text": "Hello there", "sampling_params": {**base, **GREEDY}})["output_ids"]
    # min_p 1 keeps only the most likely token: sampling at temperature 1 is then greedy.
    top_only = live.generate({"text": "Hello there", "sampling_params": {**base, "temperature": 1.0, "min_p": 1.0,
                                                                         "seed": 5}})["output_ids"]
    assert top_only == greedy
    assert len(set(greedy)) < len(greedy)  # the tiny model repeats itself ...
    penalized = live.generate({"text": "Hello there", "sampling_params": {**base, **GREEDY,
                                                                          "repetition_penalty": 2.0}})["output_ids"]
    assert len(set(penalized)) > len(set(greedy))  # ... and much less under the penalty
    seeded = {**base, "temperature": 1.0}
    by_seed = live.generate({"text": "Hello there", "sampling_params": {**seeded, "seed": 11}})["output_ids"]
    by_sglang_name = live.generate({"text": "Hello there", "sampling_params": {**seeded, "sampling_seed": 11}})
    assert by_sglang_name["output_ids"] == by_seed


def test_no_stop_trim_and_special_tokens(live: Live) -> None:
    params = {"max_new_tokens": 12, "ignore_eos": True, **GREEDY}
    free = live.generate({"text": "The quick brown fox", "sampling_params": params})["text"]
    stop = free[2:4]
    cut = live.generate({"text": "The quick brown fox", "sampling_params": {**params, "stop": stop}})["text"]
    kept = live.generate({"text": "The quick brown fox", "sampling_params": {**params, "stop": stop,
                                                                            "no_stop_trim": True}})["text"]
    assert kept.startswith(cut + stop) and not cut.endswith(stop)
    # After two <|endoftext|> the tiny model writes only that special token.
    specials = live.client.generate("<|endoftext|><|endoftext|>", sampling_params=params)
    assert set(specials.output_ids) == {live.tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    shown = live.generate({"text": "<|endoftext|><|endoftext|>", "sampling_params": {**params,
                                                                                     "skip_special_tokens": False}})
    skipped = live.generate({"text": "<|endoftext|><|endoftext|>", "sampling_params": params})
    assert shown["text"] == "<|endoftext|>" * 12 and skipped["text"] == ""
    # The fast tokenizers transformers loads ignore spaces_between_special_tokens: the text is the same.
    unspaced = live.generate({"text": "<|endoftext|><|endoftext|>", "sampling_params": {
        **params, "skip_special_tokens": False, "spaces_between_special_tokens": False}})
    assert unspaced["text"] == shown["text"]


def test_ebnf_constrains_the_output(live: Live) -> None:
    grammar = 'root ::= "yes" | "no"'
    for seed in range(3):
        out = live.generate({"text": "Answer:", "sampling_params": {"max_new_tokens": 8, "ebnf": grammar,
                                                                    "temperature": 1.0, "seed": seed}})
        assert out["text"] in ("yes", "no")


def test_logprob_options_per_prompt(live: Live) -> None:
    out = live.generate({"text": ["one two three four", "five six seven"], "return_logprob": [True, False],
                         "logprob_start_len": [1, 0], "top_logprobs_num": [2, 0], "return_text_in_logprobs": True,
                         "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, **GREEDY}})
    with_logprobs, without = out[0]["meta_info"], out[1]["meta_info"]
    assert len(with_logprobs["input_token_logprobs"]) == with_logprobs["prompt_tokens"] - 1
    assert all(len(top) == 2 for top in with_logprobs["output_top_logprobs"])
    assert all(isinstance(entry[2], str) for entry in with_logprobs["output_token_logprobs"])
    assert not without.get("input_token_logprobs") and not without.get("output_token_logprobs")


# ---------------------------------------------------------------- OpenAI routes


def test_model_name_is_enforced(live: Live) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    wrong = live.post("/v1/chat/completions", {**chat, "model": "gpt-4o-mini"})
    assert wrong.status_code == 404 and wrong.json()["error"]["message"] == "The model `gpt-4o-mini` does not exist."
    assert live.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": "other"}).status_code == 404
    assert live.post("/v1/chat/completions", {**chat, "model": "tiny"}).status_code == 200
    assert live.post("/v1/chat/completions", chat).status_code == 200  # no name: the served model
    headers = {"Authorization": f"Bearer {API_KEY}"}
    card = httpx2.get(live.http.url + "/v1/models/tiny", headers=headers, timeout=30)
    assert card.status_code == 200 and card.json()["id"] == "tiny"
    assert httpx2.get(live.http.url + "/v1/models/other", headers=headers, timeout=30).status_code == 404


def test_max_tokens_below_one_and_unknown_fields_are_refused(live: Live) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for extra, field in [({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
                         ({"guided_json": {}}, "guided_json"), ({"prediction": {"type": "content"}}, "prediction"),
                         ({"logprobs": "yes"}, "logprobs")]:
        response = live.post("/v1/chat/completions", {**chat, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
    accepted = live.post("/v1/chat/completions", {**chat, "max_tokens": 1, "store": False, "metadata": {"a": "b"},
                                                  "user": "u", "service_tier": "auto"})
    assert accepted.status_code == 200, accepted.text


def test_continue_final_message_and_add_generation_prompt(live: Live) -> None:
    chat = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "The city of"}]
    params = {"max_new_tokens": 6, "ignore_eos": True, **GREEDY}
    for options, kwargs in [({"continue_final_message": True}, {"continue_final_message": True}),
                            ({"add_generation_prompt": False}, {"add_generation_prompt": False})]:
        ids = live.chat_ids(chat, **kwargs)
        expected = live.client.generate(input_ids=ids, sampling_params=params)
        reply = live.post("/v1/chat/completions", {"messages": chat, "max_tokens": 6, "ignore_eos": True,
                                                   "temperature": 0, **options}).json()
        assert reply["usage"]["prompt_tokens"] == len(ids)
        assert reply["choices"][0]["message"]["content"] == expected.text
    both = live.post("/v1/chat/completions", {"messages": chat, "continue_final_message": True,
                                              "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(live: Live) -> None:
    chat = [{"role": "user", "content": "hi"}]
    ids = live.chat_ids(chat, add_generation_prompt=True, enable_thinking=False, reasoning_effort="low")
    assert len(ids) > len(live.chat_ids(chat, add_generation_prompt=True))
    reply = live.post("/v1/chat/completions", {"messages": chat, "max_tokens": 1, "reasoning_effort": "low",
                                               "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert reply["usage"]["prompt_tokens"] == len(ids)
    reserved = live.post("/v1/chat/completions", {"messages": chat, "chat_template_kwargs": {"eos_token": "x"}})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs"
    # A value the template cannot use (it adds reasoning_effort to a string) is the request's fault: 400, not 500.
    mistyped = live.post("/v1/chat/completions", {"messages": chat, "reasoning_effort": 0.5})
    assert mistyped.status_code == 400 and "TypeError" in mistyped.json()["error"]["message"], mistyped.text


# ---------------------------------------------------------------- access log


def test_access_lines_in_process(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sgl_lite.http.access")
    ok = live.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}, **{"X-Request-Id": "abc-1"})
    assert ok.headers["x-request-id"] == "abc-1"
    refused = httpx2.post(live.http.url + "/generate", json={"text": "hi"}, timeout=30)  # no key: 401
    forged = live.post("/generate", {"text": "hi", "colour": 1}, **{"X-Request-Id": "bad\tid"})
    new_id = forged.headers["x-request-id"]
    wanted = [lambda line: line.startswith("POST /generate 200 ") and line.endswith("request_id=abc-1"),
              lambda line: line.startswith("POST /generate 401 "),
              lambda line: line.startswith("POST /generate 400 ") and new_id in line]
    def access_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "sgl_lite.http.access"]

    # A line is written once the response's last byte is sent: the client may read the response first.
    wait_until(lambda: all(any(found(line) for line in access_lines()) for found in wanted),
               lambda: f"the three access lines, among {access_lines()}", 10, poll_s=0.05)
    lines = access_lines()
    assert any(wanted[0](line) for line in lines), lines
    assert any(wanted[1](line) for line in lines) and refused.status_code == 401
    assert new_id != "bad\tid" and any(wanted[2](line) for line in lines), lines


def test_access_lines_with_bodies_in_serves_log(live: Live) -> None:
    """serve's own front (started with --log-requests) writes its access lines into serve's log."""
    long_stops = ["x" * 500] * 5  # a body longer than the logged part, with a short prompt
    live.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "stop": long_stops}},
              url=live.runtime.url, **{"X-Request-Id": "served-1"})
    live.post("/v1/chat/completions", {"messages": [], "colour": 1}, url=live.runtime.url,
              **{"X-Request-Id": "refused-1"})
    deadline = time.monotonic() + 30
    while True:  # the front's log reaches serve's stderr pipe a moment after the response
        log = live.runtime.stderr_tail()
        if "request_id=refused-1" in log and "request_id=served-1" in log:
            break
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.1)
    (served,) = [line for line in log.splitlines() if "request_id=served-1" in line]
    assert "POST /generate 200 " in served and "body={" in served
    assert len(served.split("body=", 1)[1]) == LOGGED_BODY_CHARS + len("...")  # the body, bounded
    assert any("POST /v1/chat/completions 400 " in line and "request_id=refused-1" in line for line in log.splitlines())
