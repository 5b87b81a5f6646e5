"""A chat request's prompt, rendered and tokenized as transformers' `apply_chat_template(tokenize=True)` does.

The template is rendered by the renderer the DSL uses too (lang/template_renderer.py), with the
model's bos_token and eos_token, and the text is tokenized WITHOUT the tokenizer's special tokens:
the template writes them itself, so a tokenizer that adds BOS (Llama 2/3, Mistral) must not add a
second one. When the HTTP front cannot read the tokenizer file (a runtime on another machine), the
text is sent instead, rendered with an empty bos_token, and the runtime's tokenizer adds its own BOS:
the same ids for every template that writes BOS only at the start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from sgl_lite.lang.template_renderer import ChatTemplateError, TemplateRenderer

__all__ = ["ChatPrompt", "ChatTemplate", "ChatTemplateError", "message_text", "template_message"]


@dataclass
class ChatPrompt:
    text: str | None  # exactly one of text / input_ids is set
    input_ids: list[int] | None


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._renderer = TemplateRenderer(source)
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        return self._renderer.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     bos_token=self._bos_token, eos_token=self._eos_token)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               encode: Callable[[str], list[int]] | None) -> ChatPrompt:
        """The prompt to send: token ids when `encode` (no special tokens added) is available, else text."""
        if encode is not None:
            return ChatPrompt(None, encode(self.render(messages, tools)))
        text = self._renderer.render(messages, tools=tools, add_generation_prompt=True, bos_token="",
                                     eos_token=self._eos_token)
        return ChatPrompt(text, None)

    @cached_property
    def renders_tools(self) -> bool:
        return self._renderer.renders_tools()


def message_text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A message's content as one string; list content may hold only text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for i, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{i}]: only text content parts are supported; got type {part.get('type')!r}")
        pieces.append(part["text"])
    return "".join(pieces)


def template_message(role: str, content: str, name: str | None = None,
                     tool_calls: list[dict[str, Any]] | None = None, tool_call_id: str | None = None) -> dict[str, Any]:
    """An OpenAI message as chat templates expect it (transformers' convention).

    A call's `arguments` arrive as a JSON string; templates write them with `tojson`, so they get
    the decoded object (a string that is not JSON stays a string).
    """
    message: dict[str, Any] = {"role": role, "content": content}
    if name:
        message["name"] = name
    if tool_calls:
        message["tool_calls"] = [_template_call(call) for call in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function["arguments"])
    except (TypeError, ValueError, RecursionError):  # RecursionError: nested past Python's limit
        pass
    return {"id": call.get("id"), "type": "function", "function": function}
