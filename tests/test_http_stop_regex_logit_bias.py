"""stop_regex, logit_bias, null max_new_tokens and per-request stream_interval over HTTP (`sgl-lite serve` on the
tiny random model): SGLang's /generate, OpenAI's logit_bias on /v1/completions and /v1/chat/completions, the
400s naming the field, and the worker's /get_model_info. Expected outputs come from the runtime itself
(RuntimeClient) and the model's tokenizer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx2
import pytest
from transformers import AutoTokenizer

from sgl_lite.lang.launcher import Runtime

pytestmark = pytest.mark.timeout(240)

CONTEXT = 96
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir: Path) -> Iterator[Runtime]:
    with Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, dtype="float32", context_length=CONTEXT) as rt:
        yield rt


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def digits(tokenizer: Any) -> dict[str, Any]:
    """Seeded sampling among " 1", " 2", " 3" (each biased by +100): output with something to match."""
    bias = {str(tokenizer.convert_tokens_to_ids(f"\u0120{d}")): 100.0 for d in "123"}
    return {"temperature": 1.0, "seed": 11, "max_new_tokens": 24, "ignore_eos": True, "logit_bias": bias}


def post(runtime: Runtime, path: str, body: dict[str, Any]) -> httpx2.Response:
    return httpx2.post(runtime.url + path, json=body, timeout=60)


def generate(runtime: Runtime, body: dict[str, Any]) -> dict[str, Any]:
    response = post(runtime, "/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_honours_logit_bias_and_stop_regex(runtime, tokenizer, digits) -> None:
    pattern = r"\d [23]"
    body = {"text": PROMPT, "sampling_params": {**digits, "stop_regex": pattern}}
    out = generate(runtime, body)
    expected = runtime.client.generate(PROMPT, sampling_params={**digits, "stop_regex": pattern})
    assert out["output_ids"] == expected.output_ids and out["text"] == expected.text
    assert set(out["output_ids"]) <= {int(t) for t in digits["logit_bias"]}
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert re.search(pattern, out["text"]) and not re.search(pattern, tokenizer.decode(out["output_ids"][:-1]))
    # Streamed (SGLang's events carry the text so far): each extends the one before, the last is the answer.
    with httpx2.stream("POST", runtime.url + "/generate", json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [e["text"] for e in events]
    assert texts[-1] == out["text"] and all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_a_requests_stream_interval_paces_its_events(runtime: Runtime, digits: dict[str, Any]) -> None:
    # The tiny model's greedy bytes make no whole character before the end: the bias writes " 1" instead.
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "stream_interval": 4,
              "logit_bias": dict(list(digits["logit_bias"].items())[:1])}
    with httpx2.stream("POST", runtime.url + "/generate", timeout=60,
                       json={"text": PROMPT, "sampling_params": params, "stream": True}) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    # SGLang's rule: the first token at once, then every 4 unsent; the end brings the rest.
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 5, 9, 10]


def test_null_max_new_tokens_runs_up_to_the_context(runtime: Runtime, tokenizer: Any) -> None:
    out = generate(runtime, {"text": PROMPT, "sampling_params": {"max_new_tokens": None, "temperature": 0,
                                                                  "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == CONTEXT - out["meta_info"]["prompt_tokens"]
    assert out["meta_info"]["prompt_tokens"] == len(tokenizer(PROMPT)["input_ids"])


@pytest.mark.parametrize("sampling, says", [
    ({"logit_bias": {"384": 5.0}}, "outside the vocabulary"),  # the runtime's check: it knows the vocabulary
    ({"logit_bias": {"five": 5.0}}, "decimal digits"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"stop_regex": "(unclosed"}, "not a valid regular expression"),
    ({"stop_regex": ["a"] * 33}, "at most 32"),
    ({"stream_interval": 0}, "stream_interval"),
])
def test_bad_values_are_a_400_naming_the_field(runtime: Runtime, sampling: dict, says: str) -> None:
    field = next(iter(sampling))
    response = post(runtime, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, **sampling}})
    assert response.status_code == 400 and field in response.text and says in response.text, response.text
    assert generate(runtime, {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}})["meta_info"]  # still serving


def test_openai_routes_take_logit_bias_and_stop_regex(runtime: Runtime, tokenizer: Any, digits) -> None:
    target = 100
    completion = post(runtime, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                   "logit_bias": {str(target): 100}})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == tokenizer.decode([target] * 4)
    chat = post(runtime, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                  "temperature": 0, "logit_bias": {str(target): 100}})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == tokenizer.decode([target] * 3)
    stopped = post(runtime, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 11,
                                                "logit_bias": digits["logit_bias"], "stop_regex": r"\d [23]"})
    expected = runtime.client.generate(PROMPT, sampling_params={**digits, "ignore_eos": False, "stop_regex": r"\d [23]"})
    assert stopped.status_code == 200, stopped.text
    assert stopped.json()["choices"][0]["text"] == expected.text
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    refused = post(runtime, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logit_bias": {"x": 1}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias", refused.text


def test_model_info_has_sglangs_keys_and_the_chat_template(runtime: Runtime) -> None:
    info = httpx2.get(runtime.url + "/get_model_info", timeout=30).json()
    # SGLang 0.5.23's /model_info keys (http_server.py), then the runtime's template, which SGLang does not report.
    sglang_keys = {"model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
                   "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
                   "has_image_understanding", "has_audio_understanding", "model_type", "architectures"}
    assert sglang_keys <= set(info)
    server = httpx2.get(runtime.url + "/server_info", timeout=30).json()
    assert info["chat_template"] == server["chat_template"] and "{%" in info["chat_template"]
    assert (info["bos_token"], info["eos_token"]) == (server["bos_token"], server["eos_token"])
    assert info["served_model_name"] == server["served_model_name"]
