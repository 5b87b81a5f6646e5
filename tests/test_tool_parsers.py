"""The tool-call parsers on model outputs, whole and streamed split at every byte boundary.

The qwen25 outputs are in the exact shape the smollm2-tools template shows the model and the
structural tag enforces (`<tool_call>\n{"name": "f", "arguments": ` ... `}\n</tool_call>`), plus the
deviations an unconstrained model writes (keys out of order, unknown functions, non-JSON blocks, a cut
call); the llama3 outputs follow Meta's documented Llama 3.1-3.3 JSON tool-call format (no Llama 3
model runs on this machine), with and without `<|python_tag|>`, several calls separated by `;`; the mistral
outputs follow the two forms SGLang's mistral parser reads (a JSON array after `[TOOL_CALLS]`, and
`[TOOL_CALLS]name[ARGS]{...}`), and hermes the qwen25 block with and without its newlines.
"""

from __future__ import annotations

import codecs
import json

import pytest

from sgl_lite.http.openai_api.tool_parsers import PARSERS, ParsedCall, ParsedOutput, collect
from sgl_lite.runtime.server_args import TOOL_CALL_PARSERS

NAMES = {"get_weather", "add", "search"}

RECORDED: list[tuple[str, str, ParsedOutput]] = [
    # qwen25 (Hermes): SmolLM2 outputs.
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     ParsedOutput("", [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')])),
    ("qwen25", 'Let me look that up.\n<tool_call>\n{"name": "search", "arguments": {"query": "café \\"東京\\" {x}"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
     ParsedOutput("Let me look that up.", [ParsedCall("search", '{"query": "café \\"東京\\" {x}"}'),
                                           ParsedCall("add", '{"a": 2, "b": 3}')])),
    ("qwen25", "The weather in Paris is sunny and 21 °C.\n",
     ParsedOutput("The weather in Paris is sunny and 21 °C.\n")),
    # Keys out of order: decided at the end tag, arguments re-serialized.
    ("qwen25", '<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>',
     ParsedOutput("", [ParsedCall("add", '{"a": 1, "b": 2}')])),
    # Not a call: an unknown function, and a block that is not JSON, stay content.
    ("qwen25", '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
     ParsedOutput('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>')),
    ("qwen25", "I would <tool_call> call it </tool_call> maybe",
     ParsedOutput("I would <tool_call> call it </tool_call> maybe")),
    # Cut by max_tokens inside the arguments: the call stands with what was written.
    ("qwen25", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     ParsedOutput("Checking.", [ParsedCall("get_weather", '{"city": "Pa')])),
    # llama3.
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     ParsedOutput("", [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')])),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "search", "parameters": '
               '{"query": "}{"}}',
     ParsedOutput("", [ParsedCall("add", '{"a": 2, "b": 3}'), ParsedCall("search", '{"query": "}{"}')])),
    ("llama3", 'Use {braces} or {"name": "Bob"} in JSON.',
     ParsedOutput('Use {braces} or {"name": "Bob"} in JSON.')),
    # mistral: the JSON array after [TOOL_CALLS], and the compact form, one marker per call.
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", '
                '"arguments": {"a": 2, "b": [3, {"c": "]}"}]}}]',
     ParsedOutput("", [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("add", '{"a": 2, "b": [3, {"c": "]}"}]}')])),
    ("mistral", 'Checking. [TOOL_CALLS]search[ARGS]{"query": "café"}[TOOL_CALLS]add[ARGS]{"a": 1}',
     ParsedOutput("Checking.", [ParsedCall("search", '{"query": "café"}'), ParsedCall("add", '{"a": 1}')])),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]\n[TOOL_CALLS] [{"name": "search", "arguments": {}}]',
     ParsedOutput("", [ParsedCall("add", '{"a": 1}'), ParsedCall("search", "{}")])),
    # A `{` opens an array element only right after a call; unknown functions stay content.
    ("mistral", 'Write {"name": "add", "arguments": {}} as JSON.', ParsedOutput('Write {"name": "add", "arguments": {}} as JSON.')),
    ("mistral", '[TOOL_CALLS] [{"name": "launch", "arguments": {}}]',
     ParsedOutput('[TOOL_CALLS] [{"name": "launch", "arguments": {}}]')),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', ParsedOutput("", [ParsedCall("get_weather", '{"city": "Pa')])),
    # hermes: the qwen25 block, with or without newlines.
    ("hermes", 'Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>\n{"name": "search", '
               '"arguments": {"query": "</tool_call>"}}\n</tool_call>',
     ParsedOutput("Sure.", [ParsedCall("add", '{"a": 1}'), ParsedCall("search", '{"query": "</tool_call>"}')])),
]


def _events_streamed(parser_name: str, pieces: list[bytes]) -> ParsedOutput:
    """Feed byte pieces as the detokenizer would: never half a UTF-8 character."""
    parser = PARSERS[parser_name](NAMES)
    decoder = codecs.getincrementaldecoder("utf-8")()
    events = []
    for piece in pieces:
        events += parser.feed(decoder.decode(piece))
    events += parser.feed(decoder.decode(b"", final=True))
    return collect(events + parser.finish())


@pytest.mark.parametrize("parser_name, text, expected", RECORDED)
def test_whole_output(parser_name: str, text: str, expected: ParsedOutput) -> None:
    assert PARSERS[parser_name](NAMES).parse(text) == expected


@pytest.mark.parametrize("parser_name, text, expected", RECORDED)
def test_streamed_split_at_every_byte_boundary(parser_name: str, text: str, expected: ParsedOutput) -> None:
    data = text.encode()
    for cut in range(len(data) + 1):
        assert _events_streamed(parser_name, [data[:cut], data[cut:]]) == expected, cut
    assert _events_streamed(parser_name, [data[i:i + 1] for i in range(len(data))]) == expected


def test_streamed_events_come_in_openai_order() -> None:
    parser = PARSERS["qwen25"](NAMES)
    text = RECORDED[1][1]
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    kinds = [type(e).__name__ for e in events]
    first_start = kinds.index("ToolCallStart")
    assert set(kinds[:first_start]) == {"ContentDelta"}
    assert kinds[first_start + 1] == "ArgumentsDelta"  # arguments only after the name
    assert sum(k == "ToolCallStart" for k in kinds) == 2


def test_stop_after_first_ignores_later_calls() -> None:
    parsed = PARSERS["qwen25"](NAMES, stop_after_first=True).parse(RECORDED[1][1])
    assert [c.name for c in parsed.calls] == ["search"]


def test_recorded_arguments_are_json() -> None:
    for _, _, expected in RECORDED:
        for call in expected.calls:
            if not call.arguments.endswith('"Pa'):
                json.loads(call.arguments)


def test_every_flag_value_has_a_parser() -> None:
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
def test_a_constrained_call_as_the_structural_tag_writes_it_parses(parser_name: str) -> None:
    fmt = PARSERS[parser_name]
    text = "".join([fmt.call_begin("add"), '{"a": 1}', fmt.call_end, fmt.call_separator,
                    fmt.call_begin("search"), '{"query": "x"}', fmt.call_end])
    assert fmt.call_begin("add").startswith(fmt.call_trigger) or parser_name == "llama3"
    assert fmt(NAMES).parse(text) == ParsedOutput("", [ParsedCall("add", '{"a": 1}'), ParsedCall("search", '{"query": "x"}')])
