"""The tool-call parser core: a character-level state machine over the model's output text.

Every decision (a call opens, its header is complete, its arguments end) is taken at one
character, never at a chunk boundary, so the events of a stream split anywhere join to the events
of the whole text: `parse` is `feed(text)` then `finish()`, and streaming calls `feed` per delta.

A call is `<trigger><header><arguments><tail>`: the header regex (matched partially while it
grows) names the function and ends at the `{` that opens the arguments; the arguments are then
streamed as written until their JSON object closes; the tail runs to `tail_end` (a format whose
header has alternatives may give each its own tail: `tail_for`). Text outside calls is content,
except whitespace (and the format's separators) between calls and around them. A continuation
trigger opens a call only right after another one (the next element of a JSON array of calls).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, Union

import regex

# A header that has not matched within this many characters is not a call.
MAX_HEADER_CHARS = 256


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


Event = Union[ContentDelta, ToolCallStart, ArgumentsDelta]


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the JSON text of the arguments, as the model wrote it


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def collect(events: list[Event]) -> ParsedOutput:
    """The content and calls that a list of events describes."""
    out = ParsedOutput("")
    pieces: list[str] = []
    for event in events:
        if isinstance(event, ContentDelta):
            pieces.append(event.text)
        elif isinstance(event, ToolCallStart):
            out.calls.append(ParsedCall(event.name, ""))
        else:
            out.calls[event.index].arguments += event.text
    out.content = "".join(pieces)
    return out


class _State(Enum):
    TEXT = "text"
    HEADER = "header"  # after a trigger, until the header matches (or cannot)
    RAW = "raw"  # a block with an end tag whose header did not match: decided at the end tag
    ARGS = "args"
    TAIL = "tail"
    DONE = "done"  # stop_after_first and one call made: the rest is ignored


class ToolCallParser:
    """Subclasses set the format: triggers, header, tail_end, separators."""

    name: ClassVar[str]
    # trigger -> whether it is part of the header text (a JSON call opening with `{`), else dropped.
    triggers: ClassVar[dict[str, bool]]
    header: ClassVar[regex.Pattern[str]]  # group "name"; ends with the `{` opening the arguments
    tail_end: ClassVar[str]  # what closes a call after its arguments ("": nothing)
    continuation_triggers: ClassVar[frozenset[str]] = frozenset()  # triggers only right after a call
    end_tag: ClassVar[str | None] = None  # a block end that lets an unmatched header be decided (RAW)
    separators: ClassVar[str] = " \t\r\n"
    # How a call is written, for the xgrammar structural tag that allows exactly this (http/openai_api/tools.py).
    call_trigger: ClassVar[str]
    call_separator: ClassVar[str]
    call_end: ClassVar[str]

    @staticmethod
    def call_begin(name: str) -> str:
        raise NotImplementedError

    def tail_for(self, header: regex.Match[str]) -> str:
        """What closes the call whose header is `header`, after its arguments."""
        return self.tail_end

    def __init__(self, tool_names: set[str], stop_after_first: bool = False) -> None:
        self._tool_names = tool_names
        self._stop_after_first = stop_after_first
        self._state = _State.TEXT
        self._pending = ""  # held-back content: a whitespace run then a possible trigger prefix
        self._trigger = ""
        self._header = ""
        self._held_space = ""  # the whitespace before a trigger: dropped if a call starts there
        self._after_call = False
        self._tail = ""  # what closes the current call after its arguments
        self._calls = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._out: list[Event] = []

    # ------------------------------------------------------------------ public

    def feed(self, text: str) -> list[Event]:
        for ch in text:
            self._char(ch)
        return self._drain()

    def finish(self) -> list[Event]:
        if self._state is _State.TEXT:
            self._content(self._pending if self._calls == 0 else self._pending.lstrip())
            self._pending = ""
        elif self._state in (_State.HEADER, _State.RAW):
            self._content(self._held_space + self._dropped_trigger() + self._header)
        self._state = _State.DONE
        return self._drain()

    def parse(self, text: str) -> ParsedOutput:
        return collect(self.feed(text) + self.finish())

    @property
    def num_calls(self) -> int:
        return self._calls

    # ------------------------------------------------------------------ the machine

    def _char(self, ch: str) -> None:
        state = self._state
        if state is _State.TEXT:
            self._text_char(ch)
        elif state is _State.HEADER:
            self._header_char(ch)
        elif state is _State.RAW:
            self._header += ch
            if self._header.endswith(self.end_tag or ""):
                self._decide_raw()
        elif state is _State.ARGS:
            self._args_char(ch)
        elif state is _State.TAIL:
            self._header += ch
            if self._header.endswith(self._tail):
                self._end_call()

    def _text_char(self, ch: str) -> None:
        if self._after_call and not self._pending and ch in self.separators:
            return
        continuing = self._after_call and not self._pending
        self._after_call = False
        self._pending += ch
        for trigger in self.triggers:
            if trigger in self.continuation_triggers and not continuing:
                continue
            if self._pending.endswith(trigger):
                self._held_space = self._pending[: -len(trigger)]
                self._pending = ""
                self._trigger = trigger
                self._header = trigger if self.triggers[trigger] else ""
                self._state = _State.HEADER
                return
        keep = self._trigger_prefix_len(self._pending)
        rest = self._pending[: len(self._pending) - keep]
        stripped = rest.rstrip()
        self._content(stripped)
        self._pending = self._pending[len(stripped):]

    def _trigger_prefix_len(self, text: str) -> int:
        best = 0
        for trigger in self.triggers:
            for k in range(min(len(trigger) - 1, len(text)), best, -1):
                if text.endswith(trigger[:k]):
                    best = k
                    break
        return best

    def _header_char(self, ch: str) -> None:
        self._header += ch
        match = self.header.fullmatch(self._header, partial=True)
        if match is not None and not match.partial:
            name = match.group("name")
            if name in self._tool_names:
                self._start_call(name, self.tail_for(match))
                return
            match = None
        if match is None or len(self._header) > MAX_HEADER_CHARS:
            if self.end_tag is not None and not self._header.endswith(self.end_tag):
                self._state = _State.RAW
            elif self.end_tag is not None:
                self._decide_raw()
            else:
                self._revert()

    def _start_call(self, name: str, tail: str) -> None:
        self._out.append(ToolCallStart(self._calls, name))
        self._out.append(ArgumentsDelta(self._calls, "{"))
        self._tail = tail
        self._held_space = ""
        self._state = _State.ARGS
        self._depth, self._in_string, self._escaped = 1, False, False

    def _args_char(self, ch: str) -> None:
        self._out.append(ArgumentsDelta(self._calls, ch))
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0 and not self._tail:
                self._end_call()
            elif self._depth == 0:
                self._state = _State.TAIL
                self._header = ""

    def _end_call(self) -> None:
        self._calls += 1
        self._header = ""
        self._after_call = True
        self._state = _State.DONE if self._stop_after_first else _State.TEXT

    def _decide_raw(self) -> None:
        """A whole block whose header did not match: a call if it is JSON naming a known tool, else content."""
        body = self._header
        end = self.end_tag or ""
        try:
            call = json.loads(body[: len(body) - len(end)])
        except ValueError:
            call = None
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if isinstance(call, dict) and call.get("name") in self._tool_names and isinstance(arguments, dict):
            self._out.append(ToolCallStart(self._calls, call["name"]))
            self._out.append(ArgumentsDelta(self._calls, json.dumps(arguments, ensure_ascii=False)))
            self._held_space = ""
            self._end_call()
            return
        self._content(self._held_space + self._dropped_trigger() + body)
        self._held_space = ""
        self._header = ""
        self._state = _State.TEXT

    def _revert(self) -> None:
        """Not a call after all: its first character is content, the rest is read again as text."""
        text = self._dropped_trigger() + self._header
        self._content(self._held_space + text[0])
        self._held_space = ""
        self._header = ""
        self._state = _State.TEXT
        for ch in text[1:]:
            self._char(ch)

    def _dropped_trigger(self) -> str:
        return "" if self.triggers.get(self._trigger, True) else self._trigger

    def _content(self, text: str) -> None:
        if text:
            self._out.append(ContentDelta(text))

    def _drain(self) -> list[Event]:
        """The events since the last drain, adjacent ones of one kind merged."""
        merged: list[Event] = []
        for event in self._out:
            last = merged[-1] if merged else None
            if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
                merged[-1] = ContentDelta(last.text + event.text)
            elif isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == event.index:
                merged[-1] = ArgumentsDelta(event.index, last.text + event.text)
            else:
                merged.append(event)
        self._out = []
        return merged
