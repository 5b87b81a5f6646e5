"""A Responses API `input` as chat messages: a string is one user message; items are messages (text parts
only), `function_call` items (the assistant's calls, joined to the assistant turn they follow) and
`function_call_output` items (tool results); `reasoning` items (an earlier output's reasoning, which
clients resend) are left out, as reasoning models' chat templates leave earlier turns' reasoning out. Any
other item, or a part that is not text, gets a 400 naming it (`input[i].type`, `input[i].content[j].type`).
"""

from __future__ import annotations

from typing import Any

from sgl_lite.http.errors import HttpError, bad_request
from sgl_lite.http.openai_api.protocol import MAX_TOOLS, ChatMessage, FunctionCall, ToolCall

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# Content part type -> the key holding its text. Output parts come back when a client resends an answer.
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


def input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The chat messages an `input` holds, in order; HttpError 400 naming the item at fault."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    messages: list[ChatMessage] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")  # a plain {"role", "content"} is a message too
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "reasoning":
            continue
        elif kind == "function_call_output":
            content = _text(item.get("output"), f"{where}.output")
            messages.append(ChatMessage(role="tool", content=content, tool_call_id=_string(item, "call_id", where)))
        else:
            raise bad_request(f"{where}.type: {kind!r} items are not supported; give messages, function_call and "
                              "function_call_output items", f"{where}.type")
    return messages


def _message(item: dict[str, Any], where: str) -> ChatMessage:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise bad_request(f"{where}.role: must be one of {', '.join(_MESSAGE_ROLES)}; got {role!r}", f"{where}.role")
    return ChatMessage(role=role, content=_text(item.get("content"), f"{where}.content"))


def _add_call(messages: list[ChatMessage], item: dict[str, Any], where: str) -> None:
    """A function_call joins the assistant turn just before it (its text or earlier calls), else opens one."""
    call = ToolCall(id=_string(item, "call_id", where),
                    function=FunctionCall(name=_string(item, "name", where), arguments=_string(item, "arguments", where)))
    last = messages[-1] if messages else None
    if last is None or last.role != "assistant":
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        return
    calls = last.tool_calls if last.tool_calls is not None else []
    if len(calls) >= MAX_TOOLS:
        raise bad_request(f"{where}: more than {MAX_TOOLS} function calls in one assistant turn", where)
    last.tool_calls = [*calls, call]


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _missing(f"{where}.{key}", "a string", value)
    return value


def _text(content: Any, where: str) -> str:
    """A message's content or a call's output: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _missing(where, "a string or a list of text parts", content)
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise bad_request(f"{where}[{j}].type: only text parts ({', '.join(_TEXT_PARTS)}) are supported; "
                              f"got {kind!r}", f"{where}[{j}].type")
        text = part.get(key)
        if not isinstance(text, str):
            raise _missing(f"{where}[{j}].{key}", "a string", text)
        pieces.append(text)
    return "".join(pieces)


def _missing(where: str, expected: str, got: Any) -> HttpError:
    return bad_request(f"{where}: must be {expected}; got {type(got).__name__}", where)
