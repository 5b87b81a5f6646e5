"""/v1/chat/completions and /v1/completions: OpenAI requests -> runtime requests -> OpenAI responses.

Each of the n choices (times each prompt, for completions) is one runtime request; they run
concurrently and their streams are interleaved, each chunk naming its choice index.
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi.responses import JSONResponse, Response

from sgl_lite.http.chat_template import ChatTemplateError, message_text, template_message
from sgl_lite.http.content_specials import HiddenSpecials
from sgl_lite.http.errors import HttpError, bad_request
from sgl_lite.http.generation import Delta, Generation, GenerationInput, RequestRunner
from sgl_lite.http.guards.limits import HttpLimits
from sgl_lite.http.guards.prompt_budget import PromptWork, chat_characters, check_batch_prompts
from sgl_lite.http.model_context import ModelContext, ModelContextCache
from sgl_lite.http.openai_api.logprobs import LogprobCursor, chat_logprobs, completion_logprobs, echoed_completion_logprobs
from sgl_lite.http.openai_api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from sgl_lite.http.openai_api.reasoning_parser import REASONING_FORMATS, ReasoningRequest, reasoning_token_count
from sgl_lite.http.openai_api.tool_output import StreamedChoice, assistant_message, finish_reason_with_calls
from sgl_lite.http.openai_api.tools import ToolRequest, tool_request
from sgl_lite.http.sse import sse_response
from sgl_lite.runtime.protocol import SamplingParams, sampling_params_from_dict

# "abort": ended by /abort_request, with the text so far (SGLang's and vLLM's name for it)
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
# Chats with more text than this are rendered on a worker thread (a big one takes seconds in Jinja).
RENDER_INLINE_BYTES = 64 * 1024
# A finished chat's prompt and answer of more tokens than this are decoded (remembered) on a worker thread.
REMEMBER_INLINE_TOKENS = 4096


def finish_reason_name(finish_reason: dict[str, Any] | None) -> str:
    return _FINISH_REASONS.get((finish_reason or {}).get("type", "stop"), "stop")


def usage(generations: list[Generation], prompts: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Token usage: prompt tokens once per prompt (not per choice), completion tokens of every choice, and (given
    `reasoning_tokens`, where a reasoning parser split the outputs) how many of those were reasoning."""
    per_prompt = len(generations) // max(prompts, 1)
    firsts = [g.meta_info for g in generations[::per_prompt]] if generations else []
    prompt_tokens = sum(int(m.get("prompt_tokens") or 0) for m in firsts)
    completion_tokens = sum(int(g.meta_info.get("completion_tokens") or len(g.output_ids)) for g in generations)
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(int(m.get("cached_tokens") or 0) for m in firsts)},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def reasoning_tokens(reasoning: ReasoningRequest | None, context: ModelContext, outputs: list[list[int]]) -> int | None:
    """The reasoning tokens of outputs (token ids) split by `reasoning`; None without a split. Counted from each
    token's text (token_text.py): 0 when the front cannot read the model's tokenizer.json."""
    if reasoning is None:
        return None
    if not context.token_texts.available:
        return 0
    return sum(reasoning_token_count(reasoning, ids, context.token_texts.token_text) for ids in outputs)


def check_message_count(messages: list[ChatMessage], limits: HttpLimits) -> None:
    if len(messages) > limits.max_chat_messages:
        raise bad_request(f"messages has {len(messages)} entries; at most --max-chat-messages {limits.max_chat_messages}",
                          "messages")


def template_messages(messages: list[ChatMessage], hidden: HiddenSpecials | None = None) -> list[dict[str, Any]]:
    """A request's messages as its chat template takes them (with `hidden`, the special-token strings they
    write behind placeholders: content_specials.py); HttpError 400 naming what is wrong."""
    try:
        out = [template_message(m.role, message_text(m.content, f"messages[{i}].content"), m.name,
                                [c.model_dump() for c in m.tool_calls or ()], m.tool_call_id)
               for i, m in enumerate(messages)]
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    return out if hidden is None else [hidden.hide_message(m) for m in out]


def _choice_params(body: SamplingFields, num_prompts: int, max_fanout: int,
                   structural_tag: dict[str, Any] | None = None) -> list[SamplingParams]:
    """Each choice's checked sampling params; before any prompt work (rendering, tokenizing)."""
    unsupported = body.unsupported_field()
    if unsupported is not None:
        raise bad_request(unsupported[1], unsupported[0])
    # Checked before anything is sent: each prompt x choice is one runtime request.
    if num_prompts * body.n > max_fanout:
        param = "n" if num_prompts == 1 else "prompt"
        raise bad_request(f"{num_prompts} prompt(s) x n={body.n} is {num_prompts * body.n} generations; "
                          f"at most --max-request-fanout {max_fanout}", param)
    choices = []
    for choice in range(body.n):
        try:
            params_dict = body.sampling_params(choice)
            if structural_tag is not None:
                params_dict.pop("json_schema", None)  # response_format's schema is inside the tag (tools.py)
                params_dict["structural_tag"] = structural_tag
            choices.append(sampling_params_from_dict(params_dict))
        except ValueError as e:
            raise bad_request(str(e), _param_of(str(e))) from None
    return choices


@dataclass
class PreparedChat:
    context: ModelContext
    tools: ToolRequest | None
    inputs: list[GenerationInput]  # one per choice, validated, not yet sent
    reasoning: ReasoningRequest | None = None  # how the outputs' reasoning is split (--reasoning-parser)


def reasoning_request(body: ChatCompletionRequest, context: ModelContext, tools: ToolRequest | None,
                      params: SamplingParams) -> ReasoningRequest | None:
    """How a chat's outputs are split into reasoning and answer: with --reasoning-parser and separate_reasoning
    (SGLang's default), else None (the reasoning stays in the content, tags and all)."""
    if context.reasoning_parser is None or not body.separate_reasoning:
        return None
    forced_call = tools is not None and tools.constrained and tools.choice in ("required", "named")
    grammar = params.json_schema is not None or params.regex is not None or params.ebnf is not None
    return ReasoningRequest.of(REASONING_FORMATS[context.reasoning_parser], body.chat_template_kwargs,
                               body.stream_reasoning, forced_call or grammar or bool(tools and tools.answer_schema))


def _runtime_inputs(prompts: list[tuple[str | None, list[int] | None]], choices: list[SamplingParams],
                    return_logprob: bool, top_logprobs_num: int, priority: int | None) -> list[GenerationInput]:
    return [GenerationInput(text, input_ids, params, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                            priority=priority)
            for text, input_ids in prompts for params in choices]


# Runtime (SGLang) sampling field -> the OpenAI request field it comes from.
_OPENAI_FIELD = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "response_format",
                 "structural_tag": "tools", "text": "prompt", "input_ids": "prompt"}


def _param_of(message: str) -> str | None:
    if message.startswith("response_format"):
        return "response_format"
    first = message.split(" ", 1)[0]
    return _OPENAI_FIELD.get(first, first if first.isidentifier() else None)


def _with_openai_param(error: HttpError) -> HttpError:
    """Name the OpenAI field in a runtime error that names the runtime's (max_new_tokens -> max_tokens)."""
    if error.param in _OPENAI_FIELD:
        error.message = f"{_OPENAI_FIELD[error.param]}: {error.message}"
        error.param = _OPENAI_FIELD[error.param]
    return error


class OpenAIServing:
    def __init__(self, runner: RequestRunner, contexts: ModelContextCache, limits: HttpLimits,
                 work: PromptWork | None = None) -> None:
        self._runner = runner
        self._contexts = contexts
        self._limits = limits
        self.prompt_work = work or PromptWork()  # large renders and tokenizations, bounded (prompt_budget.py)

    async def chat(self, body: ChatCompletionRequest, on_stream_end: Callable[[str], None], body_bytes: int) -> Response:
        """`body_bytes`: the size of the request's body, which decides whether its chat template is rendered
        off the event loop."""
        try:
            return await self._chat(body, on_stream_end, body_bytes)
        except HttpError as e:
            raise _with_openai_param(e) from None

    async def completions(self, body: CompletionRequest, on_stream_end: Callable[[str], None]) -> Response:
        try:
            return await self._completions(body, on_stream_end)
        except HttpError as e:
            raise _with_openai_param(e) from None

    async def prepare_chat(self, body: ChatCompletionRequest, body_bytes: int) -> PreparedChat:
        """A chat request checked, rendered and tokenized into its runtime requests, nothing sent yet (the
        Responses API runs its conversations through this too). HttpError 400 names the field at fault."""
        context = await self._contexts.get()
        context.check_model(body.model)
        template = context.require_chat_template()
        check_message_count(body.messages, self._limits)
        tools = tool_request(body, context.tool_call_parser, not body.tools or template.renders_tools,
                             context.constrain_tool_calls)
        choice_params = _choice_params(body, 1, self._limits.max_request_fanout, tools.structural_tag() if tools else None)
        budget = context.budget
        budget.check_chars(chat_characters(body.messages, body.tools), "messages")  # before any rendering
        hidden = context.token_texts.hidden_specials() if context.split_special_tokens_in_messages else None
        messages = template_messages(body.messages, hidden)
        try:
            args = (messages, tools.tools if tools else None, context.token_texts.chat_encoder(hidden),
                    body.render_options())
            # the budget bounds all the template renders (contents, tool calls, tools) by the context
            prompt = await self.prompt_work.run(body_bytes > RENDER_INLINE_BYTES, template.prompt, *args)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        if prompt.input_ids is not None:  # a text prompt is measured by the runtime, before it tokenizes
            budget.check_tokens(len(prompt.input_ids), "messages")
        inputs = _runtime_inputs([(prompt.text, prompt.input_ids)], choice_params, body.logprobs, body.top_logprobs_num(),
                                 body.priority)
        return PreparedChat(context, tools, inputs, reasoning_request(body, context, tools, choice_params[0]))

    async def remember_answers(self, context: ModelContext, inputs: list[GenerationInput],
                               outputs: list[list[int]]) -> None:
        """Each finished chat's prompt ids and the ids generated for it, kept for the chats that continue
        their text (--reuse-answer-ids; TokenTexts.remember_answer)."""
        if not context.reuse_answer_ids:
            return
        for runtime_input, output_ids in zip(inputs, outputs):
            if runtime_input.input_ids is None or not output_ids:
                continue
            large = len(runtime_input.input_ids) + len(output_ids) > REMEMBER_INLINE_TOKENS
            await self.prompt_work.run(large, context.token_texts.remember_answer, runtime_input.input_ids, output_ids)

    async def _chat(self, body: ChatCompletionRequest, on_stream_end: Callable[[str], None], body_bytes: int) -> Response:
        prepared = await self.prepare_chat(body, body_bytes)
        context, tools, inputs = prepared.context, prepared.tools, prepared.inputs
        response_id = "chatcmpl-" + uuid.uuid4().hex
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._chat_events(context, response_id, inputs, include_usage, tools, prepared.reasoning)
            return await sse_response(events, on_stream_end)
        generations = await self._runner.collect_many(inputs)
        await self.remember_answers(context, inputs, [gen.output_ids for gen in generations])
        choices = []
        for index, gen in enumerate(generations):
            logprobs = None
            if body.logprobs:
                logprobs = {"content": chat_logprobs(LogprobCursor().take(gen.meta_info), context.token_texts)}
            message, num_calls = assistant_message(gen.text, tools, prepared.reasoning)
            choices.append({
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason_with_calls(finish_reason_name(gen.finish_reason), num_calls),
            })
        thought = reasoning_tokens(prepared.reasoning, context, [g.output_ids for g in generations])
        return JSONResponse(_envelope(response_id, "chat.completion", context, choices, usage(generations, 1, thought)))

    async def _completions(self, body: CompletionRequest, on_stream_end: Callable[[str], None]) -> Response:
        context = await self._contexts.get()
        context.check_model(body.model)
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        top = body.logprobs or 0
        choice_params = _choice_params(body, len(prompts), self._limits.max_request_fanout)
        await check_batch_prompts(context.budget, prompts, "prompt", context.token_texts, self.prompt_work)
        inputs = _runtime_inputs(prompts, choice_params, body.logprobs is not None, top, body.priority)
        echo_logprobs = body.echo and body.logprobs is not None
        if echo_logprobs:
            for runtime_input in inputs:
                runtime_input.logprob_start_len = 0  # the prompt's logprobs too (how clients score text)
        response_id = "cmpl-" + uuid.uuid4().hex
        echoes = [(text or "") if body.echo else "" for text, _ in prompts for _ in range(body.n)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._completion_events(context, response_id, inputs, echoes, body.logprobs is not None,
                                             include_usage, len(prompts))
            return await sse_response(events, on_stream_end)
        generations = await self._runner.collect_many(inputs)
        choices = []
        for index, gen in enumerate(generations):
            logprobs = None
            if echo_logprobs:
                logprobs = echoed_completion_logprobs(gen.meta_info, context.token_texts)
            elif body.logprobs is not None:
                entries = LogprobCursor().take(gen.meta_info)
                logprobs = completion_logprobs(entries, context.token_texts, text_offset=0)
            choices.append({
                "index": index,
                "text": echoes[index] + gen.text,
                "logprobs": logprobs,
                "finish_reason": finish_reason_name(gen.finish_reason),
            })
        return JSONResponse(_envelope(response_id, "text_completion", context, choices, usage(generations, len(prompts))))

    async def _chat_events(self, context: ModelContext, response_id: str, inputs: list[GenerationInput],
                           include_usage: bool, tools: ToolRequest | None,
                           reasoning: ReasoningRequest | None) -> AsyncIterator[dict[str, Any]]:
        cursors = [LogprobCursor() for _ in inputs]
        streams = [StreamedChoice(tools, reasoning) for _ in inputs]
        finals: list[Generation | None] = [None] * len(inputs)
        output_ids: list[list[int]] = [[] for _ in inputs]
        async with aclosing(self._runner.stream_many(inputs)) as deltas:
            first = await _first(deltas)  # before any event: a runtime rejection becomes the HTTP status
            for index in range(len(inputs)):
                yield _chunk(response_id, "chat.completion.chunk", context,
                             {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None})
            async for index, delta in _prepend(first, deltas):
                logprobs = None
                if inputs[index].return_logprob:
                    entries = cursors[index].take(delta.meta_info)
                    logprobs = {"content": chat_logprobs(entries, context.token_texts)}
                pieces = streams[index].feed(delta.text)
                output_ids[index].extend(delta.output_ids)
                if delta.finish_reason is not None:
                    pieces += streams[index].finish()
                if not pieces and logprobs and logprobs["content"]:
                    pieces = [{"content": ""}]
                for piece in pieces:
                    yield _chunk(response_id, "chat.completion.chunk", context,
                                 {"index": index, "delta": piece, "logprobs": logprobs, "finish_reason": None})
                    logprobs = None
                if delta.finish_reason is not None:
                    finals[index] = Generation("", output_ids[index], delta.meta_info)
                    await self.remember_answers(context, [inputs[index]], [output_ids[index]])  # before the client hears
                    reason = finish_reason_with_calls(finish_reason_name(delta.finish_reason), streams[index].num_calls)
                    yield _chunk(response_id, "chat.completion.chunk", context,
                                 {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        if include_usage:
            done = [g for g in finals if g]
            thought = reasoning_tokens(reasoning, context, [g.output_ids for g in done])
            yield _chunk(response_id, "chat.completion.chunk", context, None, usage(done, 1, thought))

    async def _completion_events(self, context: ModelContext, response_id: str, inputs: list[GenerationInput],
                                 echoes: list[str], want_logprobs: bool, include_usage: bool,
                                 num_prompts: int) -> AsyncIterator[dict[str, Any]]:
        cursors = [LogprobCursor() for _ in inputs]
        offsets = [len(e) for e in echoes]
        finals: list[Generation | None] = [None] * len(inputs)
        async with aclosing(self._runner.stream_many(inputs)) as deltas:
            first = await _first(deltas)
            for index, echo in enumerate(echoes):
                if echo:
                    yield _chunk(response_id, "text_completion", context,
                                 {"index": index, "text": echo, "logprobs": None, "finish_reason": None})
            async for index, delta in _prepend(first, deltas):
                logprobs = None
                if want_logprobs:
                    entries = cursors[index].take(delta.meta_info)
                    logprobs = completion_logprobs(entries, context.token_texts, text_offset=offsets[index])
                offsets[index] += len(delta.text)
                finish = None
                if delta.finish_reason is not None:
                    finals[index] = Generation("", [], delta.meta_info)
                    finish = finish_reason_name(delta.finish_reason)
                if delta.text or finish or logprobs and logprobs["tokens"]:
                    yield _chunk(response_id, "text_completion", context,
                                 {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish})
        if include_usage:
            yield _chunk(response_id, "text_completion", context, None, usage([g for g in finals if g], num_prompts))


def _envelope(response_id: str, kind: str, context: ModelContext, choices: list[dict[str, Any]],
              token_usage: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": response_id, "object": kind, "created": int(time.time()),
                           "model": context.served_model_name, "choices": choices}
    if token_usage is not None:
        out["usage"] = token_usage
    return out


def _chunk(response_id: str, kind: str, context: ModelContext, choice: dict[str, Any] | None,
           token_usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return _envelope(response_id, kind, context, [] if choice is None else [choice], token_usage)


async def _first(deltas: AsyncIterator[tuple[int, Delta]]) -> tuple[int, Delta] | None:
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        return None


async def _prepend(first: tuple[int, Delta] | None,
                   rest: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    if first is not None:
        yield first
    async for item in rest:
        yield item
