"""A chat choice's output as OpenAI shows tool calls: `message.tool_calls` when whole, and the
streamed `delta.tool_calls` (index, id, type and name first with empty arguments, then argument
fragments), with `finish_reason: "tool_calls"` when the model stopped after calling.
"""

from __future__ import annotations

import uuid
from typing import Any

from sgl_lite.http.openai_api.tool_parsers import ArgumentsDelta, ContentDelta, Event, ToolCallStart
from sgl_lite.http.openai_api.tools import ToolRequest


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def finish_reason_with_calls(finish_reason: str, num_calls: int) -> str:
    # A call cut by max_tokens stays "length", as OpenAI reports it.
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def assistant_message(text: str, tools: ToolRequest | None) -> tuple[dict[str, Any], int]:
    """(the assistant message, how many calls it holds) for a whole output."""
    if tools is None or not tools.parses_calls:
        return {"role": "assistant", "content": text}, 0
    parsed = tools.parser().parse(text)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}, 0
    calls = [{"id": _call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, len(calls)


class StreamedChoice:
    """One choice's stream: text deltas in, OpenAI `delta` objects out."""

    def __init__(self, tools: ToolRequest | None) -> None:
        self._parser = tools.parser() if tools is not None and tools.parses_calls else None

    @property
    def num_calls(self) -> int:
        return self._parser.num_calls if self._parser is not None else 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._parser is None:
            return [{"content": text}] if text else []
        return [_delta(event) for event in self._parser.feed(text)]

    def finish(self) -> list[dict[str, Any]]:
        if self._parser is None:
            return []
        return [_delta(event) for event in self._parser.finish()]


def _delta(event: Event) -> dict[str, Any]:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ToolCallStart):
        return {"tool_calls": [{"index": event.index, "id": _call_id(), "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    assert isinstance(event, ArgumentsDelta)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
