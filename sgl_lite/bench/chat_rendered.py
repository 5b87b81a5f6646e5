"""A token-id system given each turn as a chat server would prefill it (`sgl-lite bench --prompt-format chat`).

A chat request's prompt is its conversation rendered by the model's chat template: the template's own
tokens (role headers, end-of-turn markers, a default system message) come on top of the workload's ids.
Sent over ZeroMQ or `/generate` as they are, the workload's ids are a shorter prompt than the same
conversation over `/v1/chat/completions`, so a difference between the two paths mixes the path's cost
with the template's tokens. Wrapped in `ChatRenderedBackend`, a token-id system gets each turn as the
conversation `--backend openai-chat --chat-history messages` sends (the first prompt and each observation
as user messages, each answer as an assistant message, every piece decoded to text), rendered and
tokenized by the HTTP front's own code (http/chat_template.py, http/token_text.py): the same prompt ids
over both paths.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from sgl_lite.bench.backends import GenerationBackend, StreamEvent
from sgl_lite.http.chat_template import ChatTemplate
from sgl_lite.http.token_text import TokenTexts


def conversation(pieces: Sequence[Sequence[int]], tokenizer: Any) -> list[dict[str, str]]:
    """A turn's pieces as chat messages: the user's and the model's turns in turn, the user's first."""
    return [{"role": "assistant" if i % 2 else "user", "content": tokenizer.decode(piece)} for i, piece in enumerate(pieces)]


class ChatRenderer:
    """Pieces -> the prompt ids sgl_lite's HTTP front makes of the same conversation with its defaults: the
    template with the generation prompt, special-token strings in a message's text kept as plain text, the
    text tokenized by the model folder's tokenizer.json (http/token_text.py), an answer remembered (by
    ChatRenderedBackend) keeping its generated ids."""

    def __init__(self, model_folder: str, tokenizer: Any) -> None:
        source = getattr(tokenizer, "chat_template", None)
        if not isinstance(source, str) or not source:
            raise ValueError("--prompt-format chat: the model's tokenizer has no chat template")
        self.texts = TokenTexts(model_folder)
        if not self.texts.available:
            raise ValueError(f"--prompt-format chat: no readable tokenizer.json in {model_folder}")
        self.tokenizer = tokenizer
        self.template = ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)

    def __call__(self, pieces: Sequence[Sequence[int]]) -> list[int]:
        hidden = self.texts.hidden_specials()
        messages = conversation(pieces, self.tokenizer)
        if hidden is not None:
            messages = [hidden.hide_message(m) for m in messages]
        prompt = self.template.prompt(messages, None, self.texts.chat_encoder(hidden))
        assert prompt.input_ids is not None  # the folder's tokenizer.json is readable
        return prompt.input_ids


class ChatRenderedBackend(GenerationBackend):
    """`inner` (a token-id system) with each turn rendered by `render`; everything else is `inner`'s."""

    def __init__(self, inner: GenerationBackend, render: ChatRenderer) -> None:
        self.inner = inner
        self.render = render
        self.name = inner.name

    @property
    def latency_note(self) -> str:  # type: ignore[override]
        return self.inner.latency_note

    def stream(self, input_ids: list[int], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        return self.inner.stream(input_ids, max_new_tokens)

    async def stream_turn(self, pieces: Sequence[Sequence[int]], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        prompt, output = self.render(pieces), []
        async for event in self.inner.stream(prompt, max_new_tokens):
            output.extend(event.new_ids)
            yield event
        self.render.texts.remember_answer(prompt, output)  # as the front does (--reuse-answer-ids, its default)

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()

    def replica_prompt_tokens(self) -> list[int] | None:
        return self.inner.replica_prompt_tokens()

    async def close_async_resources(self) -> None:
        await self.inner.close_async_resources()

    async def warm_up(self) -> None:
        await self.inner.warm_up()
