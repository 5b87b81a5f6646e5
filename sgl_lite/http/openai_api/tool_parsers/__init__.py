"""Tool-call parsers, by their `--tool-call-parser` names (SGLang's)."""

from __future__ import annotations

from sgl_lite.http.openai_api.tool_parsers.base import (
                                             ArgumentsDelta,
                                             ContentDelta,
                                             Event,
                                             ParsedCall,
                                             ParsedOutput,
                                             ToolCallParser,
                                             ToolCallStart,
                                             collect,
)
from sgl_lite.http.openai_api.tool_parsers.hermes import HermesParser
from sgl_lite.http.openai_api.tool_parsers.llama3 import Llama3Parser
from sgl_lite.http.openai_api.tool_parsers.mistral import MistralParser
from sgl_lite.http.openai_api.tool_parsers.qwen25 import Qwen25Parser

PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (Qwen25Parser, Llama3Parser, MistralParser, HermesParser)}

__all__ = ["PARSERS", "ArgumentsDelta", "ContentDelta", "Event", "HermesParser", "Llama3Parser", "MistralParser",
           "ParsedCall", "ParsedOutput", "Qwen25Parser", "ToolCallParser", "ToolCallStart", "collect"]
