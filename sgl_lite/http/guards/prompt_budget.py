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

The prompts of one request together (a /generate batch, a /v1/completions list prompt) have a budget
too, so that one body cannot queue a prefill that holds the server for minutes: what one request may
prefill, --max-prefill-tokens-per-request when set, else SGLang's bound on one prefill batch,
max(--max-prefill-tokens, the context length). A batch is never refused a total one of its prompts
alone could reach. Its texts are counted by characters first (more than the limit can hold: refused
untokenized), then tokenized here to count them; their ids are not sent (the runtime tokenizes each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

import anyio

from sgl_lite.http.errors import bad_request
from sgl_lite.http.token_text import TokenTexts

MAX_CONCURRENT_PROMPT_WORK = 2

# Texts of more characters than this are counted on a worker thread (as openai_api/serving.py renders).
COUNT_INLINE_CHARS = 64 * 1024

T = TypeVar("T")
Prompt = tuple[str | None, list[int] | None]  # (text, None) or (None, token ids)


@dataclass(frozen=True)
class BatchTokenLimit:
    """The most prompt tokens the prompts of one request may hold together, and the setting it comes from."""

    tokens: int
    source: str  # for the error: which flag (or flags) set it

    @classmethod
    def of_server(cls, server_args: dict[str, Any], context_length: int | None) -> BatchTokenLimit | None:
        """From the runtime's server args (its server_info); None when it says neither bound."""
        per_request = server_args.get("max_prefill_tokens_per_request")
        if per_request:
            return cls(per_request, f"--max-prefill-tokens-per-request {per_request}")
        prefill = server_args.get("max_prefill_tokens")
        if not prefill or not context_length:
            return None
        return cls(max(prefill, context_length),
                   f"max(--max-prefill-tokens {prefill}, the context length {context_length})")


@dataclass(frozen=True)
class PromptBudget:
    context_length: int | None  # None: the runtime did not say; nothing is checked
    max_token_chars: int | None  # the most characters one token decodes to; None: unknown
    batch_limit: BatchTokenLimit | None = None  # None: the prompts of one request are not bounded together

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


async def check_batch_prompts(budget: PromptBudget, prompts: Sequence[Prompt], field: str, token_texts: TokenTexts,
                              work: PromptWork) -> None:
    """400 naming `field` when the prompts of one request (two or more) hold more tokens together than
    `budget.batch_limit`, before anything is sent. Ids are counted; texts by their characters first, then,
    when `token_texts` has the tokenizer, by tokenizing them (a large batch on a worker thread of `work`)."""
    limit = budget.batch_limit
    if limit is None or len(prompts) < 2:
        return
    tokens = sum(len(ids) for _, ids in prompts if ids is not None)
    texts = [text for text, _ in prompts if text is not None]
    chars = sum(map(len, texts))
    if texts and budget.max_token_chars is not None and chars > (limit.tokens - tokens) * budget.max_token_chars:
        raise bad_request(f"{field}: the {len(prompts)} prompts of this request hold {chars} characters of text "
                          f"(and {tokens} token ids), more than {limit.tokens} tokens ({limit.source}) can hold; "
                          "send them in smaller batches", field)
    if texts and token_texts.available:
        encoded = await work.run(chars > COUNT_INLINE_CHARS, token_texts.encode_many, texts, True)
        tokens += sum(map(len, encoded))
    if tokens > limit.tokens:
        raise bad_request(f"{field}: the {len(prompts)} prompts of this request hold {tokens} tokens together; one "
                          f"request may prefill at most {limit.tokens} ({limit.source}): send them in smaller "
                          "batches", field)


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
