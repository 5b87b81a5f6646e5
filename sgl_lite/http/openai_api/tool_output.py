"""A chat choice's output as OpenAI shows tool calls: `message.tool_calls` when whole, and the
streamed `delta.tool_calls` (index, id, type and name first with empty arguments, then argument
fragments), with `finish_reason: "tool_calls"` when the model stopped after calling. With a reasoning
parser, the reasoning is `message.reasoning_content` (`delta.reasoning_content` streamed: as it comes,
or at once when it ends without stream_reasoning), as SGLang shows it.
"""

from __future__ import annotations

import uuid
from typing import Any

from sgl_lite.http.openai_api.output_parser import OutputEvent, OutputParser
from sgl_lite.http.openai_api.reasoning_parser import ReasoningDelta, ReasoningRequest
from sgl_lite.http.openai_api.tool_parsers import ArgumentsDelta, ContentDelta, ToolCallStart, collect
from sgl_lite.http.openai_api.tools import ToolRequest


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def finish_reason_with_calls(finish_reason: str, num_calls: int) -> str:
    # A call cut by max_tokens stays "length", as OpenAI reports it.
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def assistant_message(text: str, tools: ToolRequest | None,
                      reasoning: ReasoningRequest | None = None) -> tuple[dict[str, Any], int]:
    """(the assistant message, how many calls it holds) for a whole output."""
    parser = OutputParser(tools, reasoning)
    events = parser.feed(text) + parser.finish()
    message: dict[str, Any] = {"role": "assistant"}
    if reasoning is not None:
        message["reasoning_content"] = "".join(e.text for e in events if isinstance(e, ReasoningDelta)) or None
    parsed = collect([e for e in events if not isinstance(e, ReasoningDelta)])
    if not parsed.calls:
        return {**message, "content": parsed.content}, 0
    calls = [{"id": _call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls]
    return {**message, "content": parsed.content or None, "tool_calls": calls}, len(calls)


class StreamedChoice:
    """One choice's stream: text deltas in, OpenAI `delta` objects out."""

    def __init__(self, tools: ToolRequest | None, reasoning: ReasoningRequest | None = None) -> None:
        self._parser = OutputParser(tools, reasoning)
        self._stream_reasoning = reasoning is None or reasoning.stream
        self._held_reasoning = ""  # without stream_reasoning: the reasoning until it ends

    @property
    def num_calls(self) -> int:
        return self._parser.num_calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self._parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self._parser.finish()) + self._release_reasoning()

    def _deltas(self, events: list[OutputEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ReasoningDelta) and not self._stream_reasoning:
                self._held_reasoning += event.text
                continue
            out += self._release_reasoning() + [_delta(event)]
        return out

    def _release_reasoning(self) -> list[dict[str, Any]]:
        held, self._held_reasoning = self._held_reasoning, ""
        return [{"reasoning_content": held}] if held else []


def _delta(event: OutputEvent) -> dict[str, Any]:
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ToolCallStart):
        return {"tool_calls": [{"index": event.index, "id": _call_id(), "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    assert isinstance(event, ArgumentsDelta)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
