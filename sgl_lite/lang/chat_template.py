"""Role prefixes and suffixes for sgl.system/user/assistant, derived from the model's own template.

The runtime reports the tokenizer's Jinja chat template (or the one given with --chat-template).
Rendering it (template_renderer.py, the renderer the HTTP front uses too) with sentinel message
contents and cutting the output at the sentinels gives each role's prefix and suffix, so a
program's text is byte-identical to what `tokenizer.apply_chat_template` would produce for the
same messages. Templates that insert a default system message when the conversation does not
start with one (SmolLM2's does) yield `default_system_prompt`, which the executor inserts the same
way. Without a template, ChatML (or Llama-3 for Llama-3 vocabularies) is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from sgl_lite.lang.template_renderer import ChatTemplateError, TemplateRenderer

logger = logging.getLogger(__name__)

_SENTINELS = {"system": "\x00SYS\x00", "user": "\x00USR\x00", "assistant": "\x00AST\x00"}


@dataclass
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: Optional[str] = None
    stop_str: tuple[str, ...] = ()

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict[str, Any]]) -> tuple[str, str]:
        """The text around a message of `role` (history kept for SGLang signature compatibility)."""
        if role not in self.role_prefix_and_suffix:
            known = ", ".join(self.role_prefix_and_suffix)
            raise ValueError(f"chat template {self.name!r} has no role {role!r} (known: {known})")
        return self.role_prefix_and_suffix[role]


CHATML = ChatTemplate(
    name="chatml",
    role_prefix_and_suffix={
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    },
    stop_str=("<|im_end|>",),
)

LLAMA3 = ChatTemplate(
    name="llama-3-instruct",
    role_prefix_and_suffix={
        "system": ("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
        "user": ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
        "assistant": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    },
    stop_str=("<|eot_id|>",),
)


def chat_template_from_model_info(info: dict[str, Any]) -> ChatTemplate:
    """The ChatTemplate for a runtime's model_info/server_info dict (see module docstring)."""
    template = info.get("chat_template")
    eos, bos = token_text(info.get("eos_token")), token_text(info.get("bos_token"))
    if template:
        try:
            return chat_template_from_jinja(template, eos_token=eos)
        except Exception as e:  # a template we cannot cut at sentinels: fall back, but say so
            logger.warning("could not derive role prefixes from the model's chat template (%s); using a fallback", e)
    if "<|eot_id|>" in (eos, bos) or bos == "<|begin_of_text|>":
        return LLAMA3
    return CHATML


def token_text(value: Any) -> str:
    """bos/eos as server_info gives them: a string, a list of strings (several EOS: the first), or None."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, str) else ""


def _render(template: TemplateRenderer, messages: list[dict[str, str]], eos_token: str) -> str:
    # bos_token is rendered empty: a DSL program's text is tokenized by the runtime, whose tokenizer
    # adds BOS itself when the model wants one (so the prompt has one BOS, as transformers gives).
    # eos_token is the model's: templates that end each message with it (Zephyr, Mistral) need it there.
    return template.render(messages, add_generation_prompt=False, eos_token=eos_token)


def _split_at(text: str, sentinel: str) -> tuple[str, str]:
    before, found, after = text.partition(sentinel)
    if not found:
        raise ValueError("the chat template dropped or altered a message's content")
    return before, after


def _between(text: str, first: str, second: str) -> str:
    """The text between two sentinels that occur in this order."""
    return _split_at(_split_at(text, first)[1], second)[0]


def _strip_prefix(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise ValueError("a role's suffix is not stable across conversations")
    return text[len(prefix):]


def chat_template_from_jinja(source: str, eos_token: str = "") -> ChatTemplate:
    """Cut a Jinja chat template into role prefixes/suffixes with sentinel contents."""
    template = TemplateRenderer(source)

    def render(messages: list[dict[str, str]]) -> str:
        return _render(template, messages, eos_token)

    sys_s, user_s, asst_s = _SENTINELS["system"], _SENTINELS["user"], _SENTINELS["assistant"]
    sys_msg = {"role": "system", "content": sys_s}
    user_msg = {"role": "user", "content": user_s}
    asst_msg = {"role": "assistant", "content": asst_s}

    roles: dict[str, tuple[str, str]] = {}
    try:
        roles["system"] = _split_at(render([sys_msg]), sys_s)
        head: list[dict[str, str]] = [sys_msg]
    except ChatTemplateError:
        head = []  # templates without a system role (some Mistral/Gemma ones) raise on it

    # Each role's prefix is read after a preceding message, so a default system message that the
    # template inserts into a conversation without one cannot leak into the user prefix.
    conv_user = render(head + [user_msg])
    user_suffix = _split_at(conv_user, user_s)[1]
    if head:
        user_prefix = _strip_prefix(_between(conv_user, sys_s, user_s), roles["system"][1])
    else:
        user_prefix = _split_at(conv_user, user_s)[0]
    roles["user"] = (user_prefix, user_suffix)

    conv_asst = render(head + [user_msg, asst_msg])
    asst_prefix = _strip_prefix(_between(conv_asst, user_s, asst_s), user_suffix)
    roles["assistant"] = (asst_prefix, _split_at(conv_asst, asst_s)[1])

    default_system = None
    if head:
        before_user = _split_at(render([user_msg]), user_s)[0]
        injected = before_user[: len(before_user) - len(user_prefix)]
        sys_prefix, sys_suffix = roles["system"]
        if injected and injected.startswith(sys_prefix) and injected.endswith(sys_suffix):
            default_system = injected[len(sys_prefix): len(injected) - len(sys_suffix)]
    return ChatTemplate(name="model", role_prefix_and_suffix=roles, default_system_prompt=default_system)
