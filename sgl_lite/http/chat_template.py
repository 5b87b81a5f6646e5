"""Render a model's chat template the way transformers' `apply_chat_template` does.

Same Jinja environment as HF (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, a tojson that
keeps non-ASCII, raise_exception and strftime_now globals) and the same variables (messages,
add_generation_prompt, bos_token, eos_token, tools), so a template renders to the same text here as
in transformers without importing it.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, does not compile, or raised while rendering these messages."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None) -> None:
        if not source:
            raise ChatTemplateError("the model has no chat template; use /v1/completions with a plain prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                tools=None,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None


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
