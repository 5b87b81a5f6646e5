"""The Responses API's pieces without a server: the bounded response store, input items as chat messages,
output items and their streaming events, and the grammar of tools together with response_format.

The served route, driven by the real `openai` client, is tested in test_responses_http.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from xgrammar.testing import _is_grammar_accept_string

from sgl_lite.http.errors import HttpError
from sgl_lite.http.openai_api.protocol import ChatCompletionRequest, ChatMessage
from sgl_lite.http.openai_api.response_output import ResponseOutput
from sgl_lite.http.openai_api.response_store import ResponseStore, StoredResponse
from sgl_lite.http.openai_api.responses import _with_responses_param
from sgl_lite.http.openai_api.responses_input import input_messages
from sgl_lite.http.openai_api.responses_protocol import ACCEPTED_AND_IGNORED, ResponsesRequest
from sgl_lite.http.openai_api.tools import tool_request
from sgl_lite.runtime.sampling.grammar_backend import structural_tag_ebnf

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _stored(size: int) -> StoredResponse:
    return StoredResponse({"id": "x"}, (ChatMessage(role="user", content="hi"),), size)


def test_store_evicts_the_least_recently_used_by_count_and_by_bytes() -> None:
    store = ResponseStore(max_responses=3, max_bytes=100)
    for name in "abc":
        assert store.put(name, _stored(10))
    assert store.get("a") is not None  # a is now the most recently used: b goes first
    store.put("d", _stored(10))
    assert store.get("b") is None and all(store.get(n) is not None for n in "acd")
    store.put("e", _stored(75))  # 30 + 75 > 100: the least recently used go until it fits
    assert len(store) <= 3 and store.bytes <= 100 and store.get("e") is not None
    assert store.get("a") is None
    assert not store.put("huge", _stored(101)) and store.get("huge") is None  # larger than the whole store
    assert store.delete("e") and not store.delete("e") and store.get("e") is None
    assert store.bytes == sum(entry.size for entry in store._entries.values())


def test_input_items_become_chat_messages() -> None:
    assert input_messages("hi") == [ChatMessage(role="user", content="hi")]
    messages = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "2 + 3"}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "2+3"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 1, "b": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "2"}]},
        {"type": "function_call", "call_id": "call_3", "name": "add", "arguments": "{}"},
    ])
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[0].content == "2 + 3?"
    assistant = messages[1]  # the text and both calls after it are one assistant turn
    assert assistant.content == "Let me add." and [c.id for c in assistant.tool_calls or ()] == ["call_1", "call_2"]
    assert (messages[2].tool_call_id, messages[2].content, messages[3].content) == ("call_1", "5", "2")
    assert messages[4].content is None and [c.function.name for c in messages[4].tool_calls or ()] == ["add"]


@pytest.mark.parametrize("items, field", [
    ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input[1].content[0].type"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"type": "function_call", "name": "add", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "function_call_output", "call_id": "c", "output": 5}], "input[0].output"),
    ([{"role": "user", "content": [{"type": "input_text", "text": None}]}], "input[0].content[0].text"),
])
def test_bad_input_items_get_400_naming_the_item(items: list[dict[str, Any]], field: str) -> None:
    with pytest.raises(HttpError) as info:
        input_messages(items)
    assert info.value.status == 400 and info.value.param == field and info.value.message.startswith(field)


def _items_from_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rebuild the output items from streamed events alone, checking their order on the way."""
    items: dict[int, dict[str, Any]] = {}
    done: set[int] = set()
    for event in events:
        index = event["output_index"]
        kind = event["type"]
        if kind == "response.output_item.added":
            assert index == len(items) and all(i in done for i in items), "an item opens after the previous closed"
            items[index] = {**event["item"], "text": ""}
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            assert index not in done and items[index]["id"] == event["item_id"]
            items[index]["text"] += event["delta"]
        elif kind == "response.output_item.done":
            whole = event["item"]
            written = whole["content"][0]["text"] if whole["type"] == "message" else whole["arguments"]
            assert written == items[index]["text"]
            items[index] = whole
            done.add(index)
    assert done == set(items)
    return [items[i] for i in sorted(items)]


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_streamed_output_events_rebuild_the_whole_output(choice: str) -> None:
    tools = tool_request(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[ADD],
                                               tool_choice=choice), "qwen25", True, True)
    text = "Adding.\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("2", "7") + "\nDone."
    whole = ResponseOutput(tools)
    whole.feed(text)
    whole.finish(cut=False)
    streamed = ResponseOutput(tools)
    events = [event for ch in text for event in streamed.feed(ch)] + streamed.finish(cut=False)
    rebuilt = _items_from_events(events)
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(rebuilt) == strip(whole.items) == strip(streamed.items)
    if choice == "none":  # calls are not parsed: one message holds everything
        assert [i["type"] for i in whole.items] == ["message"] and whole.items[0]["content"][0]["text"] == text
        return
    assert [i["type"] for i in whole.items] == ["message", "function_call", "function_call", "message"]
    assert [json.loads(i["arguments"]) for i in whole.items[1:3]] == [{"a": 2, "b": 3}, {"a": 7, "b": 3}]
    message = whole.assistant_message()
    assert message.content == "Adding.Done." and [c.function.name for c in message.tool_calls or ()] == ["add", "add"]
    assert [c.id for c in message.tool_calls or ()] == [i["call_id"] for i in whole.items[1:3]]


def test_an_output_cut_by_max_tokens_ends_incomplete() -> None:
    tools = tool_request(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[ADD]),
                         "qwen25", True, True)
    output = ResponseOutput(tools)
    events = output.feed(CALL_TEXT[:40]) + output.finish(cut=True)
    assert [i["status"] for i in output.items] == ["incomplete"] and events[-1]["item"]["status"] == "incomplete"


def _grammar(choice: str, with_schema: bool = True) -> str:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[ADD], tool_choice=choice,
                                 response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
                                 if with_schema else None)
    tools = tool_request(body, "qwen25", True, True)
    assert tools is not None
    return structural_tag_ebnf(json.dumps(tools.structural_tag()))


@pytest.mark.parametrize("choice, accepted, refused", [
    ("auto", [CALL_TEXT, CALL_TEXT + "\n" + CALL_TEXT, '{"answer": "yes"}'], ["Hello", '{"answer": "maybe"}',
                                                                             'Hi ' + CALL_TEXT]),
    ("required", [CALL_TEXT], ['{"answer": "yes"}', "Hello"]),
    ("none", ['{"answer": "no"}'], [CALL_TEXT, "Hello"]),
])
def test_tools_with_response_format_allow_a_call_or_the_schema(choice: str, accepted: list[str],
                                                               refused: list[str]) -> None:
    grammar = _grammar(choice)
    for text in accepted:
        assert _is_grammar_accept_string(grammar, text), text
    for text in refused:
        assert not _is_grammar_accept_string(grammar, text), text
    # Without response_format, auto still allows free text before a call (unchanged).
    assert _is_grammar_accept_string(_grammar("auto", with_schema=False), "Hello " + CALL_TEXT)


def test_responses_request_maps_onto_a_chat_request() -> None:
    body = ResponsesRequest.model_validate({
        "input": "hi", "tools": [{"type": "function", "name": "add", "parameters": ADD["function"]["parameters"]}],
        "tool_choice": {"type": "function", "name": "add"}, "parallel_tool_calls": False, "max_output_tokens": 7,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": ANSWER, "strict": True}}, "temperature": 0})
    chat = body.chat_request([ChatMessage(role="user", content="hi")])
    assert chat.tools and chat.tools[0].function.name == "add" and chat.tool_choice.function.name == "add"
    assert (chat.max_completion_tokens, chat.temperature, chat.parallel_tool_calls) == (7, 0.0, False)
    assert chat.json_schema() == ANSWER
    assert body.format_config() == {"type": "json_schema", "name": "a", "schema": ANSWER, "strict": True}


def test_chat_field_names_in_errors_become_the_responses_names() -> None:
    for chat_param, message, param in [("max_tokens", "max_tokens: too many", "max_output_tokens"),
                                       ("tools[1].function.parameters", "tools[1].function.parameters: bad",
                                        "tools[1].parameters"),
                                       ("response_format", "response_format: no schema", "text.format"),
                                       ("messages", "messages has 9 entries", "input")]:
        error = _with_responses_param(HttpError(400, message, param=chat_param))
        assert error.param == param and error.message.startswith(param), (error.param, error.message)


def test_hints_are_accepted_and_other_unserved_values_refused() -> None:
    values = {"prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
              "safety_identifier": "u1", "stream_options": {"include_obfuscation": False}, "user": "u1"}
    assert set(values) == set(ACCEPTED_AND_IGNORED)
    ResponsesRequest.model_validate({"input": "hi", **values, "include": [], "truncation": "disabled",
                                     "background": False, "reasoning": {"effort": None}, "service_tier": "auto"})
    for field, value in [("include", ["reasoning.encrypted_content"]), ("background", True), ("conversation", "conv_1"),
                         ("prompt", {"id": "p"}), ("service_tier", "flex"), ("top_logprobs", 3), ("unknown", 1)]:
        with pytest.raises(ValueError, match=field):
            ResponsesRequest.model_validate({"input": "hi", field: value})
