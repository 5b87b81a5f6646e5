"""Tool calling on /v1/chat/completions, driven by the real `openai` client against a live runtime.

The tiny random model's tokenizer is rebuilt to add BOS itself and its chat template (given with
--chat-template, as a file) writes `{{ bos_token }}` first, then SmolLM2's tool template: the shape
that gave chat prompts two BOS tokens. Random weights never write a call of their own accord, so the
call modes are checked with the xgrammar constraint on (the default): every call must parse and
validate against its schema.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import openai
import pytest
from test_http import API_KEY, Live
from tokenizers import processors
from transformers import AutoTokenizer

from sgl_lite.http.app import create_app
from sgl_lite.http.chat_template import ChatTemplate
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.chat_templates import load_chat_template
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
# Bounded values (an ASCII pattern, integer ranges) keep a random model from writing for ever inside one.
CALL = {"max_tokens": 120, "temperature": 0.0}


@pytest.fixture(scope="module")
def tool_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_tools")
    for item in tiny_llama_dir.iterdir():
        shutil.copy(item, folder / item.name)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    tokenizer.chat_template = "{{ bos_token }}" + load_chat_template("smollm2-tools")
    tokenizer.save_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder)("x")["input_ids"][0] == tokenizer.bos_token_id
    (folder / "tools.jinja").write_text(tokenizer.chat_template)
    return folder


@pytest.fixture(scope="module")
def live(tool_model_dir: Path) -> Iterator[Live]:
    runtime = Runtime(model_path=str(tool_model_dir), startup_timeout=180, random_seed=0, dtype="float32",
                      chat_template=str(tool_model_dir / "tools.jinja"), tool_call_parser="qwen25")
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), api_key=API_KEY, served_model_name="tiny"))
    try:
        yield Live(runtime, http, AutoTokenizer.from_pretrained(tool_model_dir))
    finally:
        http.stop()
        runtime.shutdown()


def _create(live: Live, **request: Any) -> Any:
    # A generous timeout: the box is shared, and a random model writes up to max_tokens per choice.
    return live.openai.with_options(timeout=300).chat.completions.create(**request)


def _hf_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_chat_prompt_is_tokenized_like_transformers_with_one_bos(live: Live) -> None:
    tokenizer = live.tokenizer
    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for tools in (None, TOOLS):
        expected = _hf_ids(tokenizer, ASK, tools)
        assert expected.count(tokenizer.bos_token_id) == 1
        assert template.prompt(ASK, tools, encode).input_ids == expected
        # What the old path did (rendered text tokenized with the tokenizer's specials): two BOS.
        assert tokenizer(template.render(ASK, tools))["input_ids"].count(tokenizer.bos_token_id) == 2
    # Through the server: the prompt the runtime ran is exactly transformers' (one BOS, not two).
    response = _create(live, model="tiny", messages=ASK, max_tokens=2, temperature=0)
    assert response.usage.prompt_tokens == len(_hf_ids(tokenizer, ASK))


def _check_calls(message: Any, allowed: set[str]) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for call in message.tool_calls or ():
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_required_gives_schema_valid_calls_only(live: Live) -> None:
    # One call each: a random model would otherwise go on calling until max_tokens.
    response = _create(live, model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                   parallel_tool_calls=False, n=3, seed=1, **{**CALL, "temperature": 1.0})
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert _check_calls(choice.message, {"get_weather", "add"})
    assert_idle_without_leaks(live.client)


def test_named_function_gives_exactly_that_call(live: Live) -> None:
    response = _create(live, model="tiny", messages=ASK, tools=TOOLS,
                       tool_choice={"type": "function", "function": {"name": "add"}}, **CALL)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [name for name, _ in _check_calls(choice.message, {"add"})] == ["add"]


def test_auto_and_none(live: Live) -> None:
    auto = _create(live, model="tiny", messages=ASK, tools=TOOLS, n=4, seed=3,
                                               **{**CALL, "temperature": 1.0})
    for choice in auto.choices:
        _check_calls(choice.message, {"get_weather", "add"})  # any call made is valid
        assert choice.finish_reason in ("tool_calls", "stop", "length")
        assert "<tool_call>" not in (choice.message.content or "")
    none = _create(live, model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", n=4,
                                               seed=3, **{**CALL, "temperature": 1.0})
    for choice in none.choices:
        assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"
        assert "<tool_call>" not in choice.message.content


def test_parallel_calls_and_their_switch(live: Live) -> None:
    def calls_and_reasons(parallel: bool) -> tuple[list[int], set[str]]:
        response = _create(
            live, model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, n=8,
            seed=5, **{**CALL, "temperature": 1.0, "max_tokens": 100})
        counts = []
        for choice in response.choices:
            calls = choice.message.tool_calls or []
            # A random model may go on calling until max_tokens: every call but a cut last one is whole.
            whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]
            _check_calls(type("M", (), {"tool_calls": whole})(), {"get_weather", "add"})
            counts.append(len(calls))
        return counts, {c.finish_reason for c in response.choices}

    parallel, _ = calls_and_reasons(True)
    assert max(parallel) >= 2, parallel
    single, reasons = calls_and_reasons(False)
    assert set(single) == {1} and reasons == {"tool_calls"}, (single, reasons)


def _reassemble(stream: Any) -> tuple[str | None, list[dict[str, Any]], str | None]:
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            for call in delta.tool_calls or ():
                if call.index not in calls:  # the first delta of a call: id, type and name, empty arguments
                    assert call.id and call.function.name and call.function.arguments == ""
                    calls[call.index] = {"name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None
                    calls[call.index]["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    return ("".join(content) or None), [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_deltas_reassemble_to_the_whole_response(live: Live, tool_choice: str) -> None:
    request = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice, seed=11,
                   **{**CALL, "temperature": 1.0})
    whole = _create(live, **request).choices[0]
    content, calls, finish = _reassemble(_create(live, **request, stream=True))
    assert content == whole.message.content
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or ()]
    assert finish == whole.finish_reason


def test_multi_turn_tool_loop_hits_the_prefix_cache(live: Live) -> None:
    messages: list[dict[str, Any]] = list(ASK)
    cached = []
    for turn in range(3):
        response = _create(live, model="tiny", messages=messages, tools=TOOLS,
                                                       tool_choice="required" if turn < 2 else "auto",
                                                       parallel_tool_calls=False, **CALL)
        message = response.choices[0].message
        cached.append((response.usage.prompt_tokens, response.usage.prompt_tokens_details.cached_tokens))
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": call.function.name})})
    assert len(cached) >= 2
    for (previous_prompt, _), (prompt, hit) in zip(cached, cached[1:]):
        assert hit >= previous_prompt, cached  # the whole previous prompt came from the cache
    assert_idle_without_leaks(live.client)


DEEP: dict[str, Any] = {"type": "object"}
_node = DEEP
for _ in range(40):
    _node["properties"] = {"x": {"type": "object"}}
    _node = _node["properties"]["x"]


@pytest.mark.parametrize("change, field", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [ADD, {"type": "function", "function": {"name": "g", "parameters": {"type": "object",
                                                                                  "properties": {"a": {"type": 7}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_malformed_tools_get_400_naming_the_field(live: Live, change: dict[str, Any], field: str) -> None:
    response = live.post("/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 4, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error
    with pytest.raises(openai.BadRequestError):
        _create(live, model="tiny", messages=ASK, max_tokens=4, **change)
    assert_idle_without_leaks(live.client)


def test_a_template_without_tools_is_refused_with_a_400_naming_tools() -> None:
    from sgl_lite.http.errors import HttpError
    from sgl_lite.http.openai_api.protocol import ChatCompletionRequest
    from sgl_lite.http.openai_api.tools import tool_request
    from sgl_lite.lang.template_renderer import TemplateRenderer
    from sgl_lite.testing.tiny_model import CHATML_TEMPLATE

    assert not TemplateRenderer(CHATML_TEMPLATE).renders_tools()
    assert TemplateRenderer(load_chat_template("smollm2-tools")).renders_tools()
    body = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    for parser, renders, needle in ((None, True, "--tool-call-parser"), ("qwen25", False, "--chat-template")):
        with pytest.raises(HttpError) as info:
            tool_request(body, parser, renders, True)
        assert info.value.status == 400 and info.value.param == "tools" and needle in info.value.message
