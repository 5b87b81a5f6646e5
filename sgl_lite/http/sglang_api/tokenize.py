"""/tokenize and /detokenize, with vLLM's request and response shapes (and `skip_special_tokens`, SGLang's).

A prompt, or a chat rendered by the model's template exactly as /v1/chat/completions renders it, becomes
the ids the runtime would be sent: a chat's `count` is the usage.prompt_tokens its completion reports.
Both run on the tokenizer file the HTTP front reads (token_text.py); a front that cannot read it (its
runtime on another machine) answers 501. Large inputs are tokenized off the event loop.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from sgl_lite.http.chat_template import ChatTemplateError
from sgl_lite.http.errors import HttpError, bad_request
from sgl_lite.http.guards.limits import HttpLimits, off_loop_if, parse_body
from sgl_lite.http.guards.prompt_budget import PromptWork, chat_characters
from sgl_lite.http.model_context import ModelContext, ModelContextCache
from sgl_lite.http.openai_api.protocol import MAX_TOOLS, ChatMessage, Tool
from sgl_lite.http.openai_api.serving import RENDER_INLINE_BYTES, check_message_count, template_messages
from sgl_lite.http.openai_api.tools import check_tools

# Ids one /detokenize may name, and texts one /tokenize may hold (SGLang's list form): bounds on the work of
# one request whatever the body limit allows.
MAX_DETOKENIZE_TOKENS = 1 << 20
MAX_TOKENIZE_PROMPTS = 4096
_INLINE_IDS = 4096  # more ids than this are decoded off the event loop


class TokenizeRequest(BaseModel):
    """Either `prompt` (a text, tokenized with the tokenizer's special tokens by default, or a list of them,
    answered with a list per field as SGLang does) or `messages` (a chat, rendered by the model's template,
    which writes its own special tokens)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_TOKENIZE_PROMPTS)] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for a chat
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)
    skip_special_tokens: bool = False  # vLLM writes them out; SGLang's clients send true to leave them out


def add_tokenize_routes(app: FastAPI, contexts: ModelContextCache, limits: HttpLimits,
                        protected: list[Depends], work: PromptWork) -> None:
    """`work`: where large renders and tokenizations run (shared with the chat routes: one bound per front)."""

    @app.post("/tokenize", dependencies=protected)
    @app.post("/v1/tokenize", dependencies=protected, include_in_schema=False)
    async def tokenize(request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest)
        context = _with_tokenizer(await contexts.get())
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt" if body.prompt is None else "messages")
        if body.prompt is not None:
            prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            special = True if body.add_special_tokens is None else body.add_special_tokens
            # One context's worth of text in all (the cost of a request, whatever its prompts' count).
            context.budget.check_chars(sum(map(len, prompts)), "prompt")
            encoded = await work.run(sum(map(len, prompts)) > RENDER_INLINE_BYTES,
                                     context.token_texts.encode_many, prompts, special)
        else:
            encoded = [await _chat_ids(context, body, limits, len(await request.body()), work)]
        one = not isinstance(body.prompt, list)

        def answer() -> Response:  # rendered here: a long answer's JSON is built off the event loop too
            content: dict[str, Any] = {"count": [len(ids) for ids in encoded], "max_model_len": context.context_length,
                                       "tokens": encoded}
            if body.return_token_strs:
                content["token_strs"] = [[context.token_texts.piece(i) for i in ids] for ids in encoded]
            if one:
                content.update((key, value[0]) for key, value in content.items() if isinstance(value, list))
            return JSONResponse(content)

        return await off_loop_if(sum(map(len, encoded)) > _INLINE_IDS, answer)

    @app.post("/detokenize", dependencies=protected)
    @app.post("/v1/detokenize", dependencies=protected, include_in_schema=False)
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest)
        context = _with_tokenizer(await contexts.get())
        vocab = context.token_texts.vocab_size
        for i, token_id in enumerate(body.tokens):
            if not 0 <= token_id < vocab:
                raise bad_request(f"tokens[{i}] = {token_id} is not a token id of this model (0 to {vocab - 1})", "tokens")
        text = await off_loop_if(len(body.tokens) > _INLINE_IDS, context.token_texts.decode, body.tokens,
                                  body.skip_special_tokens)
        return {"prompt": text}


async def _chat_ids(context: ModelContext, body: TokenizeRequest, limits: HttpLimits, body_bytes: int,
                    work: PromptWork) -> list[int]:
    """The chat's ids as /v1/chat/completions would send them; the same budget (its characters before it is
    rendered), without the refusal of a prompt over the context (the answer's count says by how much)."""
    assert body.messages is not None
    template = context.require_chat_template()
    check_message_count(body.messages, limits)
    context.budget.check_chars(chat_characters(body.messages, body.tools), "messages")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    if tools:
        check_tools(tools)  # the limits a chat completion's tools get
        if not template.renders_tools:
            raise bad_request("tools: the model's chat template does not render tools", "tools")
    hidden = context.token_texts.hidden_specials() if context.split_special_tokens_in_messages else None
    messages = template_messages(body.messages, hidden)
    encode = context.token_texts.chat_encoder(hidden, add_special_tokens=bool(body.add_special_tokens))
    assert encode is not None  # _with_tokenizer

    def render_and_encode() -> list[int]:
        return encode(template.render(messages, tools, add_generation_prompt=body.add_generation_prompt))

    try:
        return await work.run(body_bytes > RENDER_INLINE_BYTES, render_and_encode)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None


def _with_tokenizer(context: ModelContext) -> ModelContext:
    if not context.token_texts.available:
        raise HttpError(501, "this HTTP front cannot read the model's tokenizer.json (is the runtime on another "
                             "machine?), so it cannot tokenize")
    return context

