"""Reasoning parsers, by their `--reasoning-parser` names (SGLang's): a model's `<think>...</think>`
reasoning split from its answer, as `reasoning_content` on chat completions and reasoning items in
/v1/responses.

As in SGLang, a format's output may start inside the reasoning without writing `<think>` (its chat
template wrote it: `force_reasoning`): deepseek-r1 always does, qwen3 unless the request turns thinking
off (chat_template_kwargs `enable_thinking: false`, whose template then writes an empty think block).
The first `<think>` of an output is dropped and opens the reasoning; `</think>` closes it; for qwen3, a
`<tool_call>` inside the reasoning closes it too and stays in the answer. An output that ends inside the
reasoning is all reasoning. Like the tool-call parsers, every decision is taken at one character, so a
stream split anywhere parses like the whole text.

`reasoning_token_count` gives usage's reasoning_tokens from the output's token ids: each token's text fed to a
parser of its own, the tokens counted up to the one that closes the reasoning (as SGLang counts them up to
its end-of-think tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from sgl_lite.http.openai_api.tool_parsers import ContentDelta


@dataclass
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    always_reasons: bool  # the output always starts inside the reasoning
    thinking_switch: str | None = None  # the chat_template_kwargs key that turns thinking off (default on)
    tool_start: str | None = None  # a tool call that, opened inside the reasoning, closes it
    start: str = "<think>"
    end: str = "</think>"


REASONING_FORMATS: dict[str, ReasoningFormat] = {fmt.name: fmt for fmt in (
    ReasoningFormat("qwen3", always_reasons=False, thinking_switch="enable_thinking", tool_start="<tool_call>"),
    ReasoningFormat("deepseek-r1", always_reasons=True),
)}

ReasoningEvent = Union[ReasoningDelta, ContentDelta]


@dataclass(frozen=True)
class ReasoningRequest:
    """How one request's outputs are split: the format, whether they start inside the reasoning, and whether
    streamed reasoning is sent as it comes (stream_reasoning) or at once when it ends."""

    fmt: ReasoningFormat
    starts_inside: bool
    stream: bool = True

    @classmethod
    def of(cls, fmt: ReasoningFormat, chat_template_kwargs: dict[str, Any] | None, stream: bool,
           constrained_from_start: bool) -> ReasoningRequest:
        """`constrained_from_start`: a grammar shapes the output from its first token (a required or named
        tool call, response_format, regex, ebnf), which leaves no room to reason first."""
        thinking = fmt.always_reasons or (chat_template_kwargs or {}).get(fmt.thinking_switch or "", True) is True
        return cls(fmt, thinking and not constrained_from_start, stream)

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.fmt, self.starts_inside)


class ReasoningParser:
    def __init__(self, fmt: ReasoningFormat, starts_inside: bool) -> None:
        self._fmt = fmt
        self._inside = starts_inside
        self._start_seen = False
        self._ended = False
        self._pending = ""  # held back: a possible start of a tag
        self._out: list[ReasoningEvent] = []

    def feed(self, text: str) -> list[ReasoningEvent]:
        for ch in text:
            self._char(ch)
        return self._drain()

    def finish(self) -> list[ReasoningEvent]:
        self._emit(self._pending)
        self._pending = ""
        return self._drain()

    @property
    def in_reasoning(self) -> bool:
        return self._inside

    @property
    def reasoning_ended(self) -> bool:
        return self._ended

    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a whole output."""
        events = self.feed(text) + self.finish()
        return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
                "".join(e.text for e in events if isinstance(e, ContentDelta)))

    def _tags(self) -> list[str]:
        fmt = self._fmt
        tags = [] if self._start_seen or self._ended else [fmt.start]
        if self._inside:
            tags += [fmt.end] + ([fmt.tool_start] if fmt.tool_start else [])
        return tags

    def _char(self, ch: str) -> None:
        self._pending += ch
        tags = self._tags()
        for tag in tags:
            if self._pending.endswith(tag):
                self._emit(self._pending[: -len(tag)])
                self._pending = ""
                if tag == self._fmt.start:
                    self._start_seen = self._inside = True
                else:
                    self._inside, self._ended = False, True
                    if tag != self._fmt.end:  # the tool call opened: it belongs to the answer
                        self._emit(tag)
                return
        keep = max((k for tag in tags for k in range(1, len(tag)) if self._pending.endswith(tag[:k])), default=0)
        self._emit(self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]

    def _emit(self, text: str) -> None:
        if not text:
            return
        kind = ReasoningDelta if self._inside else ContentDelta
        last = self._out[-1] if self._out else None
        if isinstance(last, kind):
            last.text += text
        else:
            self._out.append(kind(text))

    def _drain(self) -> list[ReasoningEvent]:
        out, self._out = self._out, []
        return out


def reasoning_token_count(request: ReasoningRequest, output_ids: list[int], token_text: Callable[[int], str]) -> int:
    """How many of an output's tokens are its reasoning: those up to and including the token that closes it,
    all of them when the output ends inside it, none when it never enters it."""
    parser = request.parser()
    for count, token_id in enumerate(output_ids, 1):
        parser.feed(token_text(token_id))
        if parser.reasoning_ended:
            return count
    return len(output_ids) if parser.in_reasoning else 0
