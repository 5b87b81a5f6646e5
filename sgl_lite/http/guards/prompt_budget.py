"""What a prompt may cost the HTTP front before anything is sent: characters before any rendering or
tokenizing, tokens after, and a bound on how many renders and tokenizations run at once.

The budget is the model's context: a prompt longer than the context can never run, so nothing is spent
on one. Its characters are checked first (no token decodes to more characters than the longest
vocabulary entry has, so more than context length x that many characters cannot fit: the runtime's own
first check of a text, runtime/managers/validation.py), when a chat's or a /tokenize request's text is
counted from its fields, before the chat template renders it; its tokens after tokenizing, before the
ids are sent to the runtime. Large renders and tokenizations run on worker threads, at most
MAX_CONCURRENT_PROMPT_WORK at a time per front (more wait their turn), so the event loop keeps
answering everyone else, /health included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import anyio

from sgl_lite.http.errors import bad_request

MAX_CONCURRENT_PROMPT_WORK = 2

T = TypeVar("T")


@dataclass(frozen=True)
class PromptBudget:
    context_length: int | None  # None: the runtime did not say; nothing is checked
    max_token_chars: int | None  # the most characters one token decodes to; None: unknown

    @property
    def max_chars(self) -> int | None:
        if self.context_length is None or self.max_token_chars is None:
            return None
        return self.context_length * self.max_token_chars

    def check_chars(self, chars: int, field: str) -> None:
        """400 naming `field` when `chars` characters cannot fit in the context."""
        limit = self.max_chars
        if limit is not None and chars > limit:
            raise bad_request(f"{field}: {chars} characters cannot fit in the context: at most {limit} (the context "
                              f"length {self.context_length} tokens x {self.max_token_chars} characters, the "
                              "longest token)", field)

    def check_tokens(self, tokens: int, field: str) -> None:
        """400 naming `field` when a prompt of `tokens` tokens is longer than the context."""
        if self.context_length is not None and tokens > self.context_length:
            raise bad_request(f"{field}: the prompt is {tokens} tokens; the context length is {self.context_length}",
                              field)


def chat_characters(messages: Iterable[Any], tools: Iterable[Any] | None) -> int:
    """The characters a chat brings to its template: every message's text (content parts too), name, tool
    call id and tool calls (name, arguments), and each tool's name and description (a tool's `parameters`
    have their own limit, openai_api/tools.py). Counted from the parsed request: O(messages + tools)."""
    total = 0
    for message in messages:
        total += _content_chars(message.content) + len(message.name or "") + len(message.tool_call_id or "")
        for call in message.tool_calls or ():
            total += len(call.id) + len(call.function.name) + len(call.function.arguments)
    for tool in tools or ():
        total += len(tool.function.name) + len(tool.function.description or "")
    return total


def _content_chars(content: str | list[dict[str, Any]] | None) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part["text"]) for part in content if isinstance(part.get("text"), str))


class PromptWork:
    """Renders and tokenizations of one front: small ones inline, large ones on worker threads, at most
    `workers` of those at a time (the rest wait for a turn, without holding a thread)."""

    def __init__(self, workers: int = MAX_CONCURRENT_PROMPT_WORK) -> None:
        self._limiter = anyio.CapacityLimiter(workers)

    async def run(self, large: bool, fn: Callable[..., T], *args: Any) -> T:
        if not large:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
