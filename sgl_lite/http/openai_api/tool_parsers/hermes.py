"""Hermes tool calls (NousResearch's Hermes 2/3): `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`,
the qwen25 block, which its parser reads with or without the newlines; constrained calls are written
without them, as SGLang's `hermes` parser writes them."""

from __future__ import annotations

from sgl_lite.http.openai_api.tool_parsers.qwen25 import Qwen25Parser


class HermesParser(Qwen25Parser):
    name = "hermes"
    call_separator = "\n"

    @staticmethod
    def call_begin(name: str) -> str:
        return '<tool_call>{"name": "' + name + '", "arguments": '

    call_end = "}</tool_call>"
