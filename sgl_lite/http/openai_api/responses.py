"""/v1/responses: OpenAI's Responses API (create, retrieve, delete; streamed with its event types), run on
the chat path.

A response's conversation is the stored conversation of `previous_response_id` (its input and output,
without its instructions, as OpenAI keeps it), then `instructions` as the system message, then the new
`input`: it becomes one chat completion request (serving.py renders and tokenizes it like any chat, tools
and text.format included), and the chat's output becomes output items (response_output.py). With `store`
(the default) the response and its conversation are kept (response_store.py), so the next turn sends only
what is new, and its prompt starts with the previous one: the radix cache serves that part.
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from sgl_lite.http.errors import HttpError, bad_request
from sgl_lite.http.generation import Generation, RequestRunner
from sgl_lite.http.guards.disconnect import cancel_on_disconnect
from sgl_lite.http.guards.limits import HttpLimits, parse_body
from sgl_lite.http.metrics import HttpMetrics
from sgl_lite.http.openai_api.protocol import ChatMessage
from sgl_lite.http.openai_api.response_output import ResponseOutput
from sgl_lite.http.openai_api.response_store import ResponseStore, StoredResponse
from sgl_lite.http.openai_api.responses_input import input_messages
from sgl_lite.http.openai_api.responses_protocol import ResponsesNamedToolChoice, ResponsesRequest
from sgl_lite.http.openai_api.serving import OpenAIServing, PreparedChat, finish_reason_name, reasoning_tokens, usage
from sgl_lite.http.sse import sse_response

ENDPOINT = "/v1/responses"
# A chat field (or runtime field) named in an error -> the Responses API field the caller wrote.
_RESPONSES_PARAM = {"messages": "input", "prompt": "input", "text": "input", "input_ids": "input",
                    "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                    "max_new_tokens": "max_output_tokens", "response_format": "text.format", "json_schema": "text.format"}


def not_found(response_id: str, param: str) -> HttpError:
    # vLLM's message for the same case.
    return HttpError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")


@dataclass
class _Turn:
    """One response being made: its request, its prepared chat, and the conversation it continues."""

    id: str
    created_at: int
    body: ResponsesRequest
    model: str
    prepared: PreparedChat
    conversation: tuple[ChatMessage, ...]  # the previous conversation and this input, without instructions
    conversation_bytes: int

    def response(self, status: str, output: list[dict[str, Any]], token_usage: dict[str, Any] | None,
                 incomplete_reason: str | None = None) -> dict[str, Any]:
        body = self.body
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": choice.model_dump() if isinstance(choice, ResponsesNamedToolChoice) else (choice or "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "text": {"format": body.format_config()}, "truncation": "disabled", "store": body.stores,
            "background": False, "metadata": body.metadata or {}, "user": body.user, "usage": token_usage,
        }


def response_usage(meta_info: dict[str, Any], reasoning: int | None = None) -> dict[str, Any]:
    """The Responses API's usage; `reasoning`: the output's reasoning tokens (None: no reasoning parser split it)."""
    chat = usage([Generation("", [], meta_info)], 1)
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning or 0},
            "total_tokens": chat["total_tokens"]}


class ResponsesServing:
    def __init__(self, chat: OpenAIServing, runner: RequestRunner, store: ResponseStore, limits: HttpLimits) -> None:
        self._chat = chat
        self._runner = runner
        self.store = store
        self._limits = limits

    async def create(self, body: ResponsesRequest, body_bytes: int, on_stream_end: Callable[[str], None]) -> Response:
        try:
            return await self._create(body, body_bytes, on_stream_end)
        except HttpError as e:
            raise _with_responses_param(e) from None

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id, "response_id")
        return stored.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def _create(self, body: ResponsesRequest, body_bytes: int, on_stream_end: Callable[[str], None]) -> Response:
        if isinstance(body.input, list) and len(body.input) > self._limits.max_chat_messages:  # cheapest first
            raise bad_request(f"input has {len(body.input)} items; at most --max-chat-messages "
                              f"{self._limits.max_chat_messages}", "input")
        history: tuple[ChatMessage, ...] = ()
        history_bytes = 0
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            history, history_bytes = previous.conversation, previous.conversation_bytes
        conversation = (*history, *input_messages(body.input))
        instructions = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
        if not conversation:
            raise bad_request("input: no items, and no previous_response_id to continue", "input")
        # The render runs off the event loop when the whole conversation, not only this body, is large.
        prepared = await self._chat.prepare_chat(body.chat_request([*instructions, *conversation]),
                                                 body_bytes + history_bytes)
        turn = _Turn("resp_" + uuid.uuid4().hex, int(time.time()), body, prepared.context.served_model_name, prepared,
                     conversation, history_bytes + body_bytes)
        if body.stream:
            return await sse_response(self._events(turn), on_stream_end, named_events=True)
        generation = await self._runner.collect(prepared.inputs[0])
        await self._chat.remember_answers(prepared.context, prepared.inputs, [generation.output_ids])
        output = ResponseOutput(prepared.tools, prepared.reasoning)
        output.feed(generation.text)
        reason = finish_reason_name(generation.finish_reason)
        output.finish(cut=reason != "stop")
        return JSONResponse(self._finish(turn, output, generation.meta_info, reason, generation.output_ids))

    async def _events(self, turn: _Turn) -> AsyncIterator[dict[str, Any]]:
        numbers = iter(range(1 << 62))
        output = ResponseOutput(turn.prepared.tools, turn.prepared.reasoning)
        meta_info: dict[str, Any] = {}
        reason = "stop"
        output_ids: list[int] = []
        async with aclosing(self._runner.stream(turn.prepared.inputs[0])) as deltas:
            # Before any event: a runtime rejection becomes the HTTP status (sse.py).
            delta = await anext(deltas, None)
            started = turn.response("in_progress", [], None)
            yield {"type": "response.created", "sequence_number": next(numbers), "response": started}
            yield {"type": "response.in_progress", "sequence_number": next(numbers), "response": started}
            while delta is not None:
                output_ids.extend(delta.output_ids)
                for event in output.feed(delta.text):
                    yield {**event, "sequence_number": next(numbers)}
                if delta.finish_reason is not None:
                    meta_info, reason = delta.meta_info, finish_reason_name(delta.finish_reason)
                delta = await anext(deltas, None)
        for event in output.finish(cut=reason != "stop"):
            yield {**event, "sequence_number": next(numbers)}
        await self._chat.remember_answers(turn.prepared.context, turn.prepared.inputs, [output_ids])
        response = self._finish(turn, output, meta_info, reason, output_ids)  # stored before the client hears it is done
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield {"type": kind, "sequence_number": next(numbers), "response": response}

    def _finish(self, turn: _Turn, output: ResponseOutput, meta_info: dict[str, Any], reason: str,
                output_ids: list[int]) -> dict[str, Any]:
        """The finished response object; stored with its conversation when the request asked for it."""
        prepared = turn.prepared
        token_usage = response_usage(meta_info, reasoning_tokens(prepared.reasoning, prepared.context, [output_ids]))
        if reason == "stop":
            response = turn.response("completed", output.items, token_usage)
        elif reason == "length":
            response = turn.response("incomplete", output.items, token_usage, "max_output_tokens")
        else:  # ended by /abort_request: the output so far
            response = turn.response("cancelled", output.items, token_usage)
        if turn.body.stores:
            conversation = (*turn.conversation, output.assistant_message())
            self.store.put(turn.id, StoredResponse(response, conversation, turn.conversation_bytes + output.output_bytes))
        return response


def _with_responses_param(error: HttpError) -> HttpError:
    """Name the Responses API field in an error from the chat path (messages -> input, tools[0].function.name
    -> tools[0].name, max_tokens -> max_output_tokens)."""
    param = error.param
    if param is None:
        return error
    head = param.split("[", 1)[0].split(".", 1)[0]
    renamed = param.replace(".function.", ".") if head == "tools" else _RESPONSES_PARAM.get(head, head) + param[len(head):]
    if renamed != param:
        rest = error.message[len(param):] if error.message.startswith(param) else ": " + error.message
        error.message, error.param = renamed + rest, renamed
    return error


def add_responses_routes(app: FastAPI, chat: OpenAIServing, runner: RequestRunner, limits: HttpLimits,
                         metrics: HttpMetrics, protected: list[Depends], store: ResponseStore | None = None) -> ResponsesServing:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}; returns the serving object (its `store`)."""
    serving = ResponsesServing(chat, runner, store if store is not None else ResponseStore(), limits)

    @app.post(ENDPOINT, dependencies=protected)
    async def create_response(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        body_bytes = len(await request.body())  # read once, by parse_body: starlette keeps it
        on_end = lambda outcome: metrics.count_request(ENDPOINT, outcome)  # noqa: E731
        response = await cancel_on_disconnect(request, serving.create(body, body_bytes, on_end))
        if not body.stream:  # a stream is counted when it ends (sse.py)
            metrics.count_request(ENDPOINT, "success")
        return response

    @app.get(ENDPOINT + "/{response_id}", dependencies=protected)
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return serving.retrieve(response_id)

    @app.delete(ENDPOINT + "/{response_id}", dependencies=protected)
    async def delete_response(response_id: str) -> dict[str, Any]:
        return serving.delete(response_id)

    return serving
