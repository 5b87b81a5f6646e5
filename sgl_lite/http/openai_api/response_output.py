"""A response's output items, built from the model's text as it arrives, and the Responses API's streaming
events that announce them.

The text goes through the request's reasoning parser (with --reasoning-parser) and tool-call parser
(output_parser.py), whose events become items in the order the model wrote them: reasoning opens a
`reasoning` item (one `reasoning_text` part), text a `message` item (one `output_text` part), each call a
`function_call` item (`call_id`, `name`, `arguments` as JSON text). Streamed, an item is announced by
`response.output_item.added` (a message also by `response.content_part.added`), grows by
`response.reasoning_text.delta`, `response.output_text.delta` or `response.function_call_arguments.delta`,
and ends with the matching `.done` events and `response.output_item.done`. A whole (non-streamed) response runs the same machine and
keeps only the items, so both ways give the same output.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sgl_lite.http.openai_api.output_parser import OutputEvent, OutputParser
from sgl_lite.http.openai_api.protocol import ChatMessage, FunctionCall, ToolCall
from sgl_lite.http.openai_api.reasoning_parser import ReasoningDelta, ReasoningRequest
from sgl_lite.http.openai_api.tool_parsers import ArgumentsDelta, ContentDelta
from sgl_lite.http.openai_api.tools import ToolRequest


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


@dataclass
class _Item:
    index: int  # output_index
    id: str
    kind: str  # "message" | "reasoning" | "function_call"
    call_id: str = ""
    name: str = ""
    pieces: list[str] = field(default_factory=list)  # the message's text, or the call's arguments

    def text(self) -> str:
        return "".join(self.pieces)

    def body(self, status: str) -> dict[str, Any]:
        """The item as the API shows it, with everything written so far."""
        if self.kind == "message":
            content = [_text_part(self.text())] if status != "in_progress" else []
            return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": content}
        if self.kind == "reasoning":
            parts = [{"type": "reasoning_text", "text": self.text()}] if status != "in_progress" else []
            return {"id": self.id, "type": "reasoning", "summary": [], "content": parts, "status": status}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.text() if status != "in_progress" else "", "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseOutput:
    """One response's output: `feed` the model's text deltas, then `finish`; each returns the events to
    stream (without sequence numbers), and `items` holds the output items."""

    def __init__(self, tools: ToolRequest | None, reasoning: ReasoningRequest | None = None) -> None:
        self._parser = OutputParser(tools, reasoning)
        self._items: list[_Item] = []
        self._statuses: list[str] = []
        self._open: _Item | None = None

    @property
    def items(self) -> list[dict[str, Any]]:
        return [item.body(status) for item, status in zip(self._items, self._statuses)]

    @property
    def output_bytes(self) -> int:
        return sum(len(piece.encode()) for item in self._items for piece in item.pieces)

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._apply(self._parser.feed(text))

    def finish(self, cut: bool) -> list[dict[str, Any]]:
        """The output ends; `cut`: by max_output_tokens or an abort, so its last item is incomplete."""
        return self._apply(self._parser.finish()) + self._close("incomplete" if cut else "completed")

    def assistant_message(self) -> ChatMessage:
        """The output as the assistant turn of the conversation: its text, then its calls."""
        text = "".join(item.text() for item in self._items if item.kind == "message")
        calls = [ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.text()))
                 for item in self._items if item.kind == "function_call"]
        return ChatMessage(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None)

    def _apply(self, events: list[OutputEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, (ContentDelta, ReasoningDelta)):
                if not event.text:
                    continue
                kind, prefix = ("message", "msg_") if isinstance(event, ContentDelta) else ("reasoning", "rs_")
                if self._open is None or self._open.kind != kind:
                    out += self._close("completed")
                    out += self._start(_Item(len(self._items), _new_id(prefix), kind))
                item = self._open
                assert item is not None
                item.pieces.append(event.text)
                delta = {"item_id": item.id, "output_index": item.index, "content_index": 0, "delta": event.text}
                if kind == "message":
                    out.append({"type": "response.output_text.delta", **delta, "logprobs": []})
                else:
                    out.append({"type": "response.reasoning_text.delta", **delta})
            elif isinstance(event, ArgumentsDelta):
                item = self._open
                assert item is not None and item.kind == "function_call"
                item.pieces.append(event.text)
                out.append({"type": "response.function_call_arguments.delta", "item_id": item.id,
                            "output_index": item.index, "delta": event.text})
            else:  # ToolCallStart
                out += self._close("completed")
                out += self._start(_Item(len(self._items), _new_id("fc_"), "function_call", _new_id("call_"), event.name))
        return out

    def _start(self, item: _Item) -> list[dict[str, Any]]:
        self._items.append(item)
        self._statuses.append("in_progress")
        self._open = item
        out = [{"type": "response.output_item.added", "output_index": item.index, "item": item.body("in_progress")}]
        if item.kind == "message":
            out.append({"type": "response.content_part.added", "item_id": item.id, "output_index": item.index,
                        "content_index": 0, "part": _text_part("")})
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        self._statuses[item.index] = status
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            out = [{"type": "response.output_text.done", **where, "content_index": 0, "text": item.text(), "logprobs": []},
                   {"type": "response.content_part.done", **where, "content_index": 0, "part": _text_part(item.text())}]
        elif item.kind == "reasoning":
            out = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": item.text()}]
        else:
            out = [{"type": "response.function_call_arguments.done", **where, "arguments": item.text()}]
        return out + [{"type": "response.output_item.done", "output_index": item.index, "item": item.body(status)}]
