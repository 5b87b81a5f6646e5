"""Mistral tool calls, both forms SGLang's `mistral` parser reads: a JSON array after `[TOOL_CALLS]`
(`[TOOL_CALLS] [{"name": "f", "arguments": {...}}, {"name": "g", ...}]`, Mistral 7B v0.3 and its kin), and
the compact form of newer Mistral templates (`[TOOL_CALLS]f[ARGS]{...}`, one marker per call)."""

from __future__ import annotations

import regex

from sgl_lite.http.openai_api.tool_parsers.base import ToolCallParser


class MistralParser(ToolCallParser):
    name = "mistral"
    # `{` opens the next call of an array only right after a call (continuation_triggers).
    triggers = {"[TOOL_CALLS]": False, "{": True}
    continuation_triggers = frozenset({"{"})
    header = regex.compile(
        r'\s*(?:(?P<array>\[?\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]{1,64})"\s*,\s*"arguments"\s*:\s*\{)'
        r'|(?P<name>[^\s\[\]{}"\\]{1,64})\s*\[ARGS\]\s*\{)')
    tail_end = "}"  # an array element's closing brace; the compact form has none
    separators = " \t\r\n,]"
    call_trigger = "[TOOL_CALLS]"
    call_separator = "\n"

    def tail_for(self, header: regex.Match[str]) -> str:
        return self.tail_end if header.group("array") is not None else ""

    @staticmethod
    def call_begin(name: str) -> str:
        return '[TOOL_CALLS] [{"name": "' + name + '", "arguments": '

    call_end = "}]"
