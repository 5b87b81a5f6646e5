"""The one renderer of a model's Jinja chat template, shared by the DSL and the HTTP front.

Same Jinja environment as transformers' `apply_chat_template` (sandboxed, trim_blocks,
lstrip_blocks, loopcontrols, a tojson that keeps non-ASCII, raise_exception and strftime_now
globals) and the same variables (messages, tools, add_generation_prompt, bos_token, eos_token), so
a template renders to the same text here as in transformers without importing it.

Tokenizing is the caller's: transformers tokenizes the rendered text without adding special
tokens, since the template writes them itself (see http/chat_template.py).
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


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# A tool and a call of it, to find out whether a template renders tools at all.
_PROBE_TOOL = {"type": "function", "function": {"name": "sgl_lite_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = {"id": "call_probe", "type": "function",
               "function": {"name": "sgl_lite_probe_call", "arguments": {}}}


class TemplateRenderer:
    def __init__(self, source: str | None) -> None:
        if not source:
            raise ChatTemplateError("the model has no chat template; use /v1/completions with a plain prompt")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
        self.source = source

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, bos_token: str = "",
               eos_token: str = "", tools: list[dict[str, Any]] | None = None,
               variables: dict[str, Any] | None = None) -> str:
        """`variables`: more template variables (apply_chat_template's **kwargs); the named ones win over them."""
        try:
            return self._template.render({**(variables or {}), "messages": messages, "tools": tools,
                                          "add_generation_prompt": add_generation_prompt, "bos_token": bos_token,
                                          "eos_token": eos_token})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            # A template that meets a value of a type it does not expect (a caller's chat_template_kwargs, say)
            # fails in Python: the request is at fault, as with the template's own raise_exception.
            raise ChatTemplateError(f"the chat template could not render this request: {type(e).__name__}: {e}") from None

    def renders_tools(self) -> bool:
        """True when the template shows the model its tools, the calls it made and their results.

        A template without tool support renders the same text with or without `tools` and drops an
        assistant message's `tool_calls`; either makes tool calling silently wrong, so it is refused.
        """
        user = [{"role": "user", "content": "x"}]
        try:
            plain = self.render(user)
            with_tools = self.render(user, tools=[_PROBE_TOOL])
            called = self.render(user + [{"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
                                         {"role": "tool", "tool_call_id": "call_probe", "content": "y"}],
                                 tools=[_PROBE_TOOL])
        except ChatTemplateError:
            return False
        return _PROBE_TOOL["function"]["name"] in with_tools and with_tools != plain \
            and _PROBE_CALL["function"]["name"] in called
