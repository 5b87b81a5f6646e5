"""The HTTP front against a live runtime (tiny random model), driven by the real `openai` client.

One runtime process and one HTTP server (uvicorn in a thread, loopback, free port, API key on)
serve the whole module. Expected outputs come from the runtime itself through RuntimeClient and
from transformers' own chat template rendering, never from constants.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(180)

API_KEY = "test-key-123"
GREEDY = {"temperature": 0.0}


class Live:
    def __init__(self, runtime: Runtime, http: HttpServerThread, tokenizer: Any) -> None:
        self.runtime = runtime
        self.http = http
        self.tokenizer = tokenizer
        self.openai = openai.OpenAI(base_url=http.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    @property
    def client(self) -> RuntimeClient:
        return self.runtime.client

    def post(self, path: str, body: Any, key: str | None = API_KEY) -> httpx2.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx2.post(self.http.url + path, json=body, headers=headers, timeout=60)

    def get(self, path: str, key: str | None = API_KEY) -> httpx2.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx2.get(self.http.url + path, headers=headers, timeout=60)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The prompt text transformers itself renders from the model's chat template."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path) -> Iterator[Live]:
    # float32: seeded sampling then gives the same tokens however requests happen to be batched.
    runtime = Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, random_seed=0, dtype="float32")
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), api_key=API_KEY, served_model_name="tiny"))
    try:
        yield Live(runtime, http, AutoTokenizer.from_pretrained(tiny_llama_dir))
    finally:
        http.stop()
        runtime.shutdown()


# A Llama-2-style template: bos_token, raise_exception, loop variables, and block tags whose
# newlines only trim_blocks/lstrip_blocks remove, as in transformers' Jinja environment.
LLAMA2_STYLE_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}{% set messages = messages[1:] %}
{% endif %}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('roles must alternate user/assistant') }}
    {% endif %}
    {% if message['role'] == 'user' %}
{{ bos_token + '[INST] ' + ((system + ' ') if loop.first and system is defined else '') + message['content'] | trim + ' [/INST]' }}
    {% else %}
{{ ' ' + message['content'] | trim + ' ' + eos_token }}
    {% endif %}
{% endfor %}"""


@pytest.mark.parametrize("template", ["chatml", "llama2"])
def test_chat_template_renders_like_transformers(tiny_llama_dir: Path, template: str) -> None:
    from sgl_lite.http.chat_template import ChatTemplate, ChatTemplateError

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    if template == "llama2":
        tokenizer.chat_template = LLAMA2_STYLE_TEMPLATE
    ours = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Café? 東京"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render(messages) == expected
    if template == "llama2":
        with pytest.raises(ChatTemplateError, match="roles must alternate"):
            ours.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_chat_completion_renders_the_chat_template_like_transformers(live: Live) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    response = live.openai.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
    expected = live.client.generate(live.chat_prompt(messages), sampling_params={"max_new_tokens": 8, **GREEDY})
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == {"stop": "stop", "length": "length"}[expected.meta_info["finish_reason"]["type"]]
    prompt_ids = live.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(prompt_ids, list):  # transformers 5 returns a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected.output_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")


def test_completion_equals_runtime_output_and_honours_stop(live: Live) -> None:
    prompt = "The quick brown fox"
    response = live.openai.completions.create(model="tiny", prompt=prompt, max_tokens=10, **GREEDY)
    expected = live.client.generate(prompt, sampling_params={"max_new_tokens": 10, **GREEDY})
    assert response.choices[0].text == expected.text
    assert response.usage.prompt_tokens == expected.meta_info["prompt_tokens"]
    # A stop string taken from the greedy output: the text ends right before its first occurrence.
    stop = expected.text[3:5]
    assert stop, f"greedy output too short to pick a stop string: {expected.text!r}"
    stopped = live.openai.completions.create(model="tiny", prompt=prompt, max_tokens=10, stop=[stop], **GREEDY)
    assert stopped.choices[0].text == expected.text[: expected.text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_streamed_chat_chunks_join_to_the_non_streamed_text(live: Live) -> None:
    messages = [{"role": "user", "content": "Tell me about Paris and Berlin."}]
    whole = live.openai.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **GREEDY)
    stream = live.openai.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streamed_completion_with_two_choices(live: Live) -> None:
    prompt = "def add(a, b):"
    whole = live.openai.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=2, **GREEDY)
    texts = ["", ""]
    for chunk in live.openai.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=2, stream=True, **GREEDY):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert texts[0] == texts[1]  # greedy: both choices are the same


def test_seeded_sampling_is_reproducible_and_choices_use_distinct_seeds(live: Live) -> None:
    def sample() -> list[str]:
        response = live.openai.completions.create(model="tiny", prompt="Once", max_tokens=8, n=3, seed=7,
                                                  temperature=1.0)
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = sample()
    assert sample() == first
    one = live.client.generate("Once", sampling_params={"max_new_tokens": 8, "temperature": 1.0, "seed": 8})
    assert first[1] == one.text  # choice i uses seed + i


def test_json_schema_response_format_parses(live: Live) -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    response = live.openai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris as JSON"}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}, **GREEDY)
    value = json.loads(response.choices[0].message.content)
    assert value["city"] in ("Paris", "Berlin") and isinstance(value["sunny"], bool) and set(value) == {"city", "sunny"}
    assert response.choices[0].finish_reason == "stop"


def test_chat_and_completion_logprobs(live: Live) -> None:
    chat = live.openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "café"}],
                                               max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    # A random model emits partial UTF-8 characters too: `bytes` are exact, the text holds U+FFFD for them.
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == chat.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-3)  # greedy picks the top one
        assert token.logprob <= 0
    stream = live.openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "café"}],
                                                 max_tokens=6, logprobs=True, top_logprobs=3, stream=True, **GREEDY)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # Same tokens; the logprobs may differ in the last float bits (the prompt is a cache hit now).
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    completion = live.openai.completions.create(model="tiny", prompt="Berlin is", max_tokens=6, logprobs=2, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == completion.usage.completion_tokens
    # Greedy: no alternative is likelier than the chosen token (two ids may share a text, so compare by value).
    assert all(1 <= len(top) <= 2 and max(top.values()) <= lp + 1e-3
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]


def test_concurrent_clients_get_their_own_answers(live: Live) -> None:
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(6)]
    expected = [live.client.generate(p, sampling_params={"max_new_tokens": 6, **GREEDY}).text for p in prompts]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        client = openai.OpenAI(base_url=live.http.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        answers[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=6, **GREEDY).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [answers.get(i) for i in range(len(prompts))] == expected


def test_second_chat_turn_reports_cached_tokens(live: Live) -> None:
    messages = [{"role": "system", "content": "Thought: I should call a tool. Cache test system prompt."},
                {"role": "user", "content": "Action: search[weather in Paris]"}]
    first = live.openai.chat.completions.create(model="tiny", messages=messages, max_tokens=5, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Observation: It is sunny."}]
    second = live.openai.chat.completions.create(model="tiny", messages=messages, max_tokens=5, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The whole first prompt is a prefix of the second one (ChatML), so at least that much is reused.
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_sent_back_is_found_cached_as_generated(live: Live, stream: bool) -> None:
    """An answer whose text tokenizes to other ids than the model wrote is found in the prefix cache whole when
    the next turn sends it back (--reuse-answer-ids, on). The tiny model samples one letter a token, from
    letters its tokenizer also merges (a logit bias bans every other token), so its text tokenizes shorter."""
    messages = [{"role": "system", "content": f"Answer reuse, stream={stream}."}, {"role": "user", "content": "Go."}]
    letters = {str(i): 0 for i in range(len(live.tokenizer)) if live.tokenizer.decode([i]) in list("etaoinsrh ")}
    banned = {str(i): -100 for i in range(len(live.tokenizer)) if str(i) not in letters}
    for seed in range(5):
        request = {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 1.0, "seed": seed,
                   "extra_body": {"ignore_eos": True, "logit_bias": banned}}
        if stream:
            chunks = list(live.openai.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                              **request))
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            first = live.openai.chat.completions.create(**request)
            answer, usage = first.choices[0].message.content, first.usage
        if len(live.tokenizer.encode(answer, add_special_tokens=False)) < usage.completion_tokens:
            break
    else:
        pytest.fail("no answer of 5 tokenized to fewer ids than generated")
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Observation: done."}]
    second = live.openai.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **GREEDY)
    # cached: the first prompt and every answer token but the last (which never ran through the model)
    assert second.usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens + usage.completion_tokens - 1


@pytest.mark.parametrize("body, field", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"top_k": 0}, "top_k"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"regex": "(unclosed"}, "regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"max_tokens": 10_000_000}, "max_tokens"),
])
def test_bad_chat_requests_get_400_naming_the_field(live: Live, body: dict[str, Any], field: str) -> None:
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = live.post("/v1/chat/completions", request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"
    assert_idle_without_leaks(live.client)


def test_openai_client_raises_bad_request_with_message(live: Live) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        live.openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=0)
    assert excinfo.value.status_code == 400 and "top_p" in excinfo.value.message


def test_wrong_or_missing_key_gets_401_but_health_stays_open(live: Live) -> None:
    wrong = openai.OpenAI(base_url=live.http.url + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as excinfo:
        wrong.models.list()
    assert excinfo.value.status_code == 401
    assert live.post("/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    assert live.get("/metrics", key=None).status_code == 401
    assert live.get("/health", key=None).status_code == 200
    assert [m.id for m in live.openai.models.list().data] == ["tiny"]  # the app's served_model_name


def test_native_generate_plain_streamed_and_batched(live: Live) -> None:
    params = {"max_new_tokens": 7, **GREEDY}
    expected = live.client.generate("Hello there", sampling_params=params)
    plain = live.post("/generate", {"text": "Hello there", "sampling_params": params}).json()
    assert plain["text"] == expected.text and plain["output_ids"] == expected.output_ids
    assert plain["meta_info"]["finish_reason"] == expected.meta_info["finish_reason"]
    with httpx2.stream("POST", live.http.url + "/generate", json={"text": "Hello there", "sampling_params": params,
                       "stream": True}, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    cumulative = [json.loads(e)["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(cumulative, cumulative[1:])) and cumulative[-1] == expected.text
    batch = live.post("/generate", {"input_ids": [expected.output_ids[:2], [5, 6, 7]], "sampling_params": params}).json()
    assert [len(item["output_ids"]) <= 7 for item in batch] == [True, True]
    bad = live.post("/generate", {"text": "x", "sampling_params": {"max_new_tokenz": 3}})
    assert bad.status_code == 400 and "max_new_tokenz" in bad.json()["error"]["message"]
    assert live.post("/flush_cache", {}).status_code == 200


def test_client_disconnect_aborts_the_runtime_request(live: Live) -> None:
    body = {"model": "tiny", "prompt": "A journey of a thousand miles", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    steps_before = live.client.server_info()["num_forward_steps"]
    got_output = False
    with httpx2.stream("POST", live.http.url + "/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                got_output = True
                break  # got real output: hang up mid-generation
    assert got_output, "the stream ended before any output: nothing was disconnected mid-generation"
    info = assert_idle_without_leaks(live.client)
    # Running to the end would take a prefill and 1499 decode steps; the abort stopped it well before.
    assert info["num_forward_steps"] - steps_before < 1500


def _scrape(live: Live) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = live.get("/metrics")
    assert response.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_metrics_counters_move_between_scrapes(live: Live) -> None:
    before = _scrape(live)
    response = live.openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "metrics"}],
                                                   max_tokens=5, **GREEDY)
    live.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1})
    after = _scrape(live)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    chat = "/v1/chat/completions"
    assert delta("sgl_lite_http_requests_total", endpoint=chat, outcome="success") == 1
    assert delta("sgl_lite_http_requests_total", endpoint=chat, outcome="bad_request") == 1
    assert delta("sgl_lite_prompt_tokens_total") == response.usage.prompt_tokens
    assert delta("sgl_lite_generation_tokens_total") == response.usage.completion_tokens
    assert delta("sgl_lite_cached_tokens_total") == response.usage.prompt_tokens_details.cached_tokens
    assert delta("sgl_lite_time_to_first_token_seconds_count", priority="none") == 1
    assert delta("sgl_lite_e2e_request_latency_seconds_count", priority="none") == 1
    assert delta("sgl_lite_inter_token_latency_seconds_count", priority="none") == response.usage.completion_tokens - 1
    info = live.client.server_info()
    assert after[("sgl_lite_kv_slots_total", ())] == info["slots_total"]
    assert after[("sgl_lite_runtime_up", ())] == 1
    for name in ("sgl_lite_num_queue_reqs", "sgl_lite_num_running_reqs", "sgl_lite_kv_slots_used",
                 "sgl_lite_kv_slots_evictable", "sgl_lite_cache_hit_rate", "sgl_lite_preemptions_total",
                 "sgl_lite_retractions_total"):
        assert (name, ()) in after, name
