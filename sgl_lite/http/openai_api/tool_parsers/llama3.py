"""Llama 3.x JSON tool calls: `{"name": "f", "parameters": {...}}`, optionally after `<|python_tag|>`,
several separated by `;` (Meta's format for Llama 3.1-3.3 with JSON-based tool calling)."""

from __future__ import annotations

import regex

from sgl_lite.http.openai_api.tool_parsers.base import ToolCallParser


class Llama3Parser(ToolCallParser):
    name = "llama3"
    triggers = {"<|python_tag|>": False, "{": True}
    header = regex.compile(
        r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]{1,64})"\s*,\s*"(?:parameters|arguments)"\s*:\s*\{')
    tail_end = "}"
    separators = " \t\r\n;"
    call_trigger = '{"name": '
    call_separator = ";"

    @staticmethod
    def call_begin(name: str) -> str:
        return '{"name": "' + name + '", "parameters": '

    call_end = "}"
