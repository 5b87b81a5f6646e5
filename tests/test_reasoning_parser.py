"""The reasoning parsers (http/openai_api/reasoning_parser.py) on model outputs, whole and streamed split at
every character, alone and ahead of a tool-call parser; and how a chat choice and a response show the
reasoning. The outputs follow the formats SGLang's qwen3 and deepseek-r1 parsers read (no reasoning model
runs on this machine)."""

from __future__ import annotations

import pytest

from sgl_lite.http.openai_api.output_parser import OutputParser
from sgl_lite.http.openai_api.reasoning_parser import REASONING_FORMATS, ReasoningRequest, reasoning_token_count
from sgl_lite.http.openai_api.response_output import ResponseOutput
from sgl_lite.http.openai_api.tool_output import StreamedChoice, assistant_message
from sgl_lite.http.openai_api.tool_parsers import PARSERS
from sgl_lite.http.openai_api.tools import ToolRequest
from sgl_lite.runtime.server_args import REASONING_PARSERS

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek-r1"]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
TOOLS = ToolRequest([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}], "auto",
                    None, True, PARSERS["qwen25"], False)

CASES = [
    # (format, starts inside the reasoning, output, reasoning, answer)
    (QWEN3, True, "<think>\nLet me add.\n</think>\n\n3", "\nLet me add.\n", "\n\n3"),
    (QWEN3, True, "Let me add.</think>3", "Let me add.", "3"),  # the template wrote <think>
    (QWEN3, True, "Still thinking when cut", "Still thinking when cut", ""),
    (QWEN3, True, "<think>hmm " + CALL, "hmm ", CALL),  # a tool call closes the reasoning
    (QWEN3, False, "3, no thinking: a </think> is text", "", "3, no thinking: a </think> is text"),
    (QWEN3, False, "<think>a</think>b <think>c", "a", "b <think>c"),  # only the first <think> opens it
    (R1, True, "<think>r</think>a", "r", "a"),
    (R1, True, "r " + CALL + "</think>a", "r " + CALL, "a"),  # deepseek-r1 has no tool-call exit
    (R1, True, "<thi", "<thi", ""),
]


@pytest.mark.parametrize("fmt, inside, text, reasoning, answer", CASES)
def test_whole_and_streamed_at_every_split(fmt, inside, text, reasoning, answer) -> None:
    request = ReasoningRequest(fmt, inside)
    assert request.parser().parse(text) == (reasoning, answer)
    whole = request.parser()
    expected = _merged(whole.feed(text) + whole.finish())
    for cut in range(len(text) + 1):
        parser = request.parser()
        assert _merged(parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()) == expected, cut
    parser = request.parser()
    assert _merged([e for ch in text for e in parser.feed(ch)] + parser.finish()) == expected


def _merged(events: list) -> list[tuple[str, str]]:
    """The events as (kind, text), adjacent ones of a kind joined."""
    out: list[tuple[str, str]] = []
    for event in events:
        kind = type(event).__name__
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + event.text)
        else:
            out.append((kind, event.text))
    return out


@pytest.mark.parametrize("kwargs, constrained, expected", [
    (None, False, True), ({"enable_thinking": True}, False, True), ({"enable_thinking": False}, False, False),
    ({}, True, False),
])
def test_qwen3_starts_inside_unless_thinking_is_off_or_a_grammar_shapes_the_output(kwargs, constrained, expected) -> None:
    assert ReasoningRequest.of(QWEN3, kwargs, True, constrained).starts_inside is expected
    assert ReasoningRequest.of(R1, {"enable_thinking": False}, True, False).starts_inside  # r1 always reasons


def test_reasoning_then_tool_calls() -> None:
    text = "<think>I add.</think>\n\n" + CALL
    request = ReasoningRequest(QWEN3, True)
    message, calls = assistant_message(text, TOOLS, request)
    assert calls == 1 and message["reasoning_content"] == "I add." and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    parser = OutputParser(TOOLS, request)
    streamed = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert [type(e).__name__ for e in streamed][:2] == ["ReasoningDelta", "ReasoningDelta"]
    assert parser.num_calls == 1
    # Without a reasoning parser the reasoning stays in the content, tags and all.
    assert assistant_message("<think>x</think>y", None)[0] == {"role": "assistant", "content": "<think>x</think>y"}


@pytest.mark.parametrize("stream", [True, False])
def test_streamed_choice_sends_reasoning_as_it_comes_or_at_once(stream: bool) -> None:
    choice = StreamedChoice(None, ReasoningRequest(QWEN3, True, stream))
    deltas = [d for ch in "<think>ab</think>cd" for d in choice.feed(ch)] + choice.finish()
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert "".join(reasoning) == "ab" and len(reasoning) == (2 if stream else 1)
    assert "".join(d.get("content", "") for d in deltas) == "cd"
    assert deltas[-1] == {"content": "d"}  # the reasoning comes before the answer


def test_a_response_shows_the_reasoning_as_a_reasoning_item() -> None:
    output = ResponseOutput(TOOLS, ReasoningRequest(QWEN3, True))
    events = [e for ch in "<think>I add.</think>" + CALL for e in output.feed(ch)] + output.finish(cut=False)
    reasoning, call = output.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "I add."}]
    assert call["type"] == "function_call" and call["name"] == "add"
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.output_item.added" and "response.reasoning_text.delta" in kinds
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == "I add." and kinds.index("response.reasoning_text.done") < kinds.index(
        "response.function_call_arguments.delta")
    assert output.assistant_message().content is None  # the reasoning is not kept in the conversation


@pytest.mark.parametrize("inside, pieces, expected", [
    (False, ["<th", "ink>", "ab", "</", "think", ">", "c", "d"], 6),  # up to the token that closes it
    (False, ["<think>ab</think>c", "d"], 1),  # one token may hold the whole block
    (True, ["ab", "c</think>", "d"], 2),  # opened by the chat template
    (True, ["ab", "cd"], 2),  # cut while reasoning: all of it
    (False, ["ab", "cd"], 0),  # never reasons
    (False, [" <think>", "a", "</think>"], 3),  # text before the tag does not stop it opening
    (True, ["hmm ", "<tool_call>", "x"], 2),  # qwen3: a tool call closes the reasoning
])
def test_reasoning_tokens_count_up_to_the_token_that_closes_it(inside: bool, pieces: list[str], expected: int) -> None:
    ids = list(range(100, 100 + len(pieces)))
    text_of = dict(zip(ids, pieces))
    assert reasoning_token_count(ReasoningRequest(QWEN3, inside), ids, text_of.__getitem__) == expected


def test_every_flag_value_has_a_format() -> None:
    assert set(REASONING_PARSERS) == set(REASONING_FORMATS)
