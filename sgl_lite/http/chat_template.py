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

__all__ = ["ChatPrompt", "ChatTemplate", "ChatTemplateError", "RenderOptions", "message_text", "template_message"]


@dataclass
class ChatPrompt:
    text: str | None  # exactly one of text / input_ids is set
    input_ids: list[int] | None


@dataclass(frozen=True)
class RenderOptions:
    """A chat request's say in how its template renders (apply_chat_template's arguments of the same names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last message, which the model continues
    template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)


# The template variables the renderer sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
# transformers marks the end of the final message with this, renders, and cuts the text there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._renderer = TemplateRenderer(source)
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, options: RenderOptions | None = None) -> str:
        """`options`, when given, decides add_generation_prompt (and continue_final_message, template_kwargs)."""
        if options is None:
            options = RenderOptions(add_generation_prompt=add_generation_prompt)
        return self._render(messages, tools, options, self._bos_token)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               encode: Callable[[str], list[int]] | None, options: RenderOptions | None = None) -> ChatPrompt:
        """The prompt to send: token ids when `encode` (no special tokens added) is available, else text."""
        options = options or RenderOptions()
        if encode is not None:
            return ChatPrompt(None, encode(self._render(messages, tools, options, self._bos_token)))
        return ChatPrompt(self._render(messages, tools, options, ""), None)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, options: RenderOptions,
                bos_token: str) -> str:
        """apply_chat_template(tokenize=False)'s text; with continue_final_message, as transformers: the final
        message's content gets a tag, the chat renders without a generation prompt, and the text ends where
        the tag began (ChatTemplateError when the template drops the message or the options conflict)."""
        variables = dict(options.template_kwargs or {})
        clash = sorted(RESERVED_TEMPLATE_VARIABLES & variables.keys())
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
        if not options.continue_final_message:
            return self._renderer.render(messages, tools=tools, add_generation_prompt=options.add_generation_prompt,
                                         bos_token=bos_token, eos_token=self._eos_token, variables=variables)
        if options.add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible: the first "
                                    "continues the final message, the second starts a new assistant message")
        if not messages:
            raise ChatTemplateError("continue_final_message is set but the conversation is empty")
        final = messages[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
        tagged = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        text = self._renderer.render(tagged, tools=tools, add_generation_prompt=False, bos_token=bos_token,
                                     eos_token=self._eos_token, variables=variables)
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ChatTemplateError("continue_final_message is set but the chat template does not write the final "
                                    "message as given, so it cannot be continued")
        end = text.rindex(_CONTINUE_TAG.strip())
        if text[end:end + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:end]
        return text[:end].rstrip()  # the template trimmed the trailing space: so does the continuation

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
