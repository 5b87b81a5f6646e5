"""/v1/responses and tools with response_format, driven by the real `openai` client against a live runtime.

The tiny random model serves SmolLM2's tool template (`smollm2-tools`) with the `qwen25` tool parser, what
agent users run; random weights never call a tool of their own accord, so calls are asked for with
tool_choice "required" (the xgrammar constraint makes every call valid). Expected outputs come from the
server itself: the chat completion of the same conversation, never from constants.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import jsonschema
import openai
import pytest
from test_http import API_KEY, Live
from test_tools_http import ADD, WEATHER, live, tool_model_dir  # noqa: F401  (live, tool_model_dir: fixtures)

from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.http.openai_api.response_store import ResponseStore
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(300)

TOOLS = [{"type": "function", **WEATHER["function"]}, {"type": "function", **ADD["function"]}]  # the Responses shape
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
INSTRUCTIONS = "You answer with the tools you are given."
ASK = "What is the weather in Paris, and what is 2 + 3?"
# Bounded values (an enum, an integer range) keep a random model from writing for ever inside the answer.
ANSWER = {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["verdict", "score"], "additionalProperties": False}
GREEDY = {"temperature": 0.0, "max_output_tokens": 120}


def _client(live: Live) -> openai.OpenAI:
    # A generous timeout: the box is shared, and a random model writes up to its token limit.
    return live.openai.with_options(timeout=300)


def _calls(response: Any) -> list[Any]:
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_two_turns_with_a_function_tool_through_previous_response_id(live: Live) -> None:
    client = _client(live)
    first = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=ASK, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, **GREEDY)
    assert first.status == "completed" and first.id.startswith("resp_")
    [call] = _calls(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"ok": call.name})}
    # The second turn sends only what is new: the tool's result.
    second = client.responses.create(model="tiny", instructions=INSTRUCTIONS, previous_response_id=first.id,
                                     input=[result], tools=TOOLS, tool_choice="none", **{**GREEDY, "max_output_tokens": 12})
    assert second.previous_response_id == first.id and not _calls(second)
    # The whole first prompt (and more) came from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens > 0
    # The server kept the conversation: it is what the chat completion of the whole history runs.
    history = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK},
               {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                                     "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}]
    chat = live.openai.with_options(timeout=300).chat.completions.create(
        model="tiny", messages=history, tools=[{"type": "function", "function": t} for t in (WEATHER["function"],
                                                                                             ADD["function"])],
        tool_choice="none", temperature=0.0, max_tokens=12)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    # Resending the history as input items instead gives the same prompt and answer.
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    resent = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=items, tools=TOOLS,
                                     tool_choice="none", store=False, **{**GREEDY, "max_output_tokens": 12})
    assert (resent.usage.input_tokens, resent.output_text) == (second.usage.input_tokens, second.output_text)
    assert_idle_without_leaks(live.client)


def _strip_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_events_build_the_same_response(live: Live, tool_choice: str) -> None:
    client = _client(live)
    request = dict(model="tiny", input=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, **GREEDY)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert events[-1].type == ("response.completed" if final.status == "completed" else "response.incomplete")
    # The items the events announce, grown by their deltas, are the final output.
    texts: dict[int, str] = {}
    for event in events:
        if event.type == "response.output_item.added":
            texts[event.output_index] = ""
        elif event.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            texts[event.output_index] += event.delta
        elif event.type == "response.output_item.done":
            item = event.item
            assert texts[event.output_index] == (item.arguments if item.type == "function_call" else item.content[0].text)
            assert item.model_dump() == final.output[event.output_index].model_dump()
    assert len(texts) == len(final.output)
    dump = lambda r: [item.model_dump(exclude_none=True) for item in r.output]  # noqa: E731
    assert _strip_ids(dump(final)) == _strip_ids(dump(whole))  # greedy: streamed or not, the same output
    assert final.usage.output_tokens == whole.usage.output_tokens
    if tool_choice == "required":
        assert [e.type for e in events if e.type.startswith("response.function_call_arguments")][-1].endswith("done")
        assert _calls(final)
    # Stored before the terminal event was sent.
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    assert_idle_without_leaks(live.client)


def test_retrieve_delete_and_unknown_ids(live: Live) -> None:
    client = _client(live)
    response = client.responses.create(model="tiny", input="Hello", temperature=0.0, max_output_tokens=4)
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    client.responses.delete(response.id)
    for attempt in (lambda: client.responses.retrieve(response.id), lambda: client.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{response.id}' not found"):
            attempt()
    reply = live.post("/v1/responses", {"model": "tiny", "input": "more", "previous_response_id": response.id})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(model="tiny", input="Hello", store=False, temperature=0.0, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="more", previous_response_id=unstored.id, max_output_tokens=4)


def test_an_evicted_response_is_unknown(live: Live) -> None:
    http = HttpServerThread(create_app(RuntimeClient(live.runtime.address), api_key=API_KEY,
                                       response_store=ResponseStore(max_responses=2)))
    try:
        client = openai.OpenAI(base_url=http.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        ids = [client.responses.create(input=f"turn {i}", temperature=0.0, max_output_tokens=2).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):  # the least recently used went first
            client.responses.create(input="more", previous_response_id=ids[0], max_output_tokens=2)
        assert client.responses.create(input="more", previous_response_id=ids[2], max_output_tokens=2).status
    finally:
        http.stop()


def test_json_schema_output_is_valid(live: Live) -> None:
    client = _client(live)
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": ANSWER, "strict": True}}
    for _ in range(3):
        response = client.responses.create(model="tiny", input="Is Paris in France?", text=fmt, temperature=1.0,
                                           max_output_tokens=60)
        assert response.status == "completed" and response.text.format.type == "json_schema"
        jsonschema.validate(json.loads(response.output_text), ANSWER)


def _check_call_or_answer(message: Any, finish_reason: str) -> str:
    """'call' or 'answer': the output is valid calls, or valid JSON of the answer schema, nothing else."""
    if message.tool_calls:
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert finish_reason == "tool_calls" and not message.content
        return "call"
    jsonschema.validate(json.loads(message.content), ANSWER)
    return "answer"


@pytest.mark.parametrize("tool_choice, allowed", [("auto", {"call", "answer"}), ("required", {"call"}),
                                                  ("none", {"answer"})])
def test_tools_with_response_format_give_a_call_or_the_schema(live: Live, tool_choice: str, allowed: set[str]) -> None:
    """pydantic-ai's NativeOutput with tools: both in one chat request, tool_choice keeping its meaning."""
    response = live.openai.with_options(timeout=300).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": ASK}], tool_choice=tool_choice, n=4, seed=7,
        tools=[WEATHER, ADD], parallel_tool_calls=False, temperature=1.0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": ANSWER}})
    kinds = {_check_call_or_answer(c.message, c.finish_reason) for c in response.choices}
    assert kinds <= allowed, kinds
    # The same through the Responses API: text.format with tools.
    output = _client(live).responses.create(
        model="tiny", input=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, **GREEDY,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": ANSWER}})
    kind = "call" if _calls(output) else "answer"
    if kind == "answer":
        jsonschema.validate(json.loads(output.output_text), ANSWER)
    assert kind in allowed
    assert_idle_without_leaks(live.client)


def test_tools_with_regex_or_ebnf_are_still_refused(live: Live) -> None:
    for constraint in ({"regex": "[ab]+"}, {"ebnf": 'root ::= "a"'}):
        reply = live.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": ASK}],
                                                   "tools": [ADD], "max_tokens": 4, **constraint})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools", reply.text


@pytest.mark.parametrize("change, field", [
    ({"temperature_x": 1}, "temperature_x"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, "tools[0].parameters"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}}, "text.format"),
    ({"input": []}, "input"),
])
def test_bad_requests_get_400_naming_the_field(live: Live, change: dict[str, Any], field: str) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **change}
    reply = live.post("/v1/responses", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith(field) and field in error["message"], error
    assert_idle_without_leaks(live.client)


def test_streams_are_named_server_sent_events(live: Live) -> None:
    """As OpenAI sends them: `event: <type>` before each `data:`, and no `[DONE]`."""
    with httpx2.stream("POST", live.http.url + "/v1/responses", timeout=300, headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "tiny", "input": "Hello", "stream": True, "max_output_tokens": 3}) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert lines[0] == "event: response.created" and "[DONE]" not in lines[-1]
    for name, data in zip(lines[::2], lines[1::2]):
        assert name == "event: " + json.loads(data.removeprefix("data: "))["type"]
