"""A model output as the OpenAI routes show it: its reasoning first (reasoning_parser.py, with
--reasoning-parser), then its answer, whose tool calls the request's tool-call parser finds (tool_parsers/).
One machine for whole and streamed outputs, fed text deltas, so both give the same events."""

from __future__ import annotations

from typing import Union

from sgl_lite.http.openai_api.reasoning_parser import ReasoningDelta, ReasoningParser, ReasoningRequest
from sgl_lite.http.openai_api.tool_parsers import ContentDelta, Event, ToolCallParser
from sgl_lite.http.openai_api.tools import ToolRequest

OutputEvent = Union[ReasoningDelta, Event]


class OutputParser:
    def __init__(self, tools: ToolRequest | None, reasoning: ReasoningRequest | None) -> None:
        self._tools: ToolCallParser | None = tools.parser() if tools is not None and tools.parses_calls else None
        self._reasoning: ReasoningParser | None = reasoning.parser() if reasoning is not None else None

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str) -> list[OutputEvent]:
        pieces = self._reasoning.feed(text) if self._reasoning is not None else [ContentDelta(text)]
        return self._answer(pieces)

    def finish(self) -> list[OutputEvent]:
        out = self._answer(self._reasoning.finish()) if self._reasoning is not None else []
        return out + (self._tools.finish() if self._tools is not None else [])

    def _answer(self, pieces: list[ReasoningDelta | ContentDelta]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for piece in pieces:
            if isinstance(piece, ReasoningDelta) or self._tools is None:
                if piece.text:
                    out.append(piece)
            else:
                out += self._tools.feed(piece.text)
        return out
