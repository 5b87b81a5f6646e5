"""Qwen 2.5 / Hermes tool calls: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call."""

from __future__ import annotations

import regex

from sgl_lite.http.openai_api.tool_parsers.base import ToolCallParser


class Qwen25Parser(ToolCallParser):
    name = "qwen25"
    triggers = {"<tool_call>": False}
    header = regex.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]{1,64})"\s*,\s*"arguments"\s*:\s*\{')
    tail_end = "</tool_call>"
    end_tag = "</tool_call>"
    call_trigger = "<tool_call>"
    call_separator = "\n"

    @staticmethod
    def call_begin(name: str) -> str:
        return '<tool_call>\n{"name": "' + name + '", "arguments": '

    call_end = "}\n</tool_call>"
