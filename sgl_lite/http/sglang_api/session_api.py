"""SGLang's session API: /open_session, /close_session, and `session_params` on /generate.

Shapes as SGLang 0.5.23 defines them (OpenSessionReqInput, CloseSessionReqInput, SessionParams). A
/generate request with `session_params` runs as the whole prompt its session makes of it (sessions.py):
the earlier request's tokens, then its own (`text` is tokenized here, as the runtime would; a leading BOS
is dropped from an appended turn, as SGLang does). Its output is recorded when it ends, so that a later
request may continue it; a request that fails leaves no trace in its session. Each runs with the session as
its `session_pin`: the runtime keeps the KV of the session's latest finished request last in its radix cache,
until the session closes or expires (SessionStore.on_end unpins it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Union

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from sgl_lite.http.errors import HttpError, bad_request
from sgl_lite.http.generation import GenerationInput
from sgl_lite.http.guards.limits import parse_body
from sgl_lite.http.guards.prompt_budget import PromptWork
from sgl_lite.http.model_context import ModelContextCache
from sgl_lite.http.sglang_api.sessions import Continuation, Session, SessionRequest, SessionStore
from sgl_lite.runtime.protocol import MAX_RID_CHARS, SessionPin

# How long a request that replaces a running one waits for that one's abort to end it.
REPLACE_WAIT_S = 30.0
# Texts longer than this are tokenized on a worker thread (prompt_budget.PromptWork).
TOKENIZE_INLINE_CHARS = 16 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class OpenSessionRequest(_Strict):
    """SGLang's OpenSessionReqInput."""

    capacity_of_str_len: int  # here: the tokens the session may hold
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_RID_CHARS)
    streaming: bool | None = None  # each request appends to the latest, one at a time
    timeout: float | None = None  # idle seconds before the session closes (default: the server's)


class CloseSessionRequest(_Strict):
    session_id: str = Field(max_length=MAX_RID_CHARS)


class SessionParams(_Strict):
    """SGLang's SessionParams: which session, and which of its requests this one continues and how."""

    id: str = Field(max_length=MAX_RID_CHARS)
    rid: str | None = Field(default=None, max_length=MAX_RID_CHARS)
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None

    def continuation(self) -> Continuation:
        return Continuation(self.rid, self.offset, bool(self.replace), bool(self.drop_previous_output))


SessionParamsField = Union[SessionParams, list[SessionParams], None]


def add_session_routes(app: FastAPI, store: SessionStore, protected: list[Depends]) -> None:

    @app.post("/open_session", dependencies=protected)
    @app.get("/open_session", dependencies=protected, include_in_schema=False)  # SGLang takes both
    async def open_session(request: Request) -> Response:
        """Open a session; answers its id (a JSON string), as SGLang does."""
        body = await parse_body(request, OpenSessionRequest)
        session_id = store.open(body.capacity_of_str_len, body.session_id, bool(body.streaming), body.timeout)
        return JSONResponse(session_id)

    @app.post("/close_session", dependencies=protected)
    @app.get("/close_session", dependencies=protected, include_in_schema=False)  # SGLang takes both
    async def close_session(request: Request) -> Response:
        """Close a session: later requests naming it get a 404; its running requests still answer their callers."""
        body = await parse_body(request, CloseSessionRequest)
        store.close(body.session_id)
        return Response(status_code=200)


class SessionTurns:
    """The session requests of one /generate call, by the index of their GenerationInput: each is recorded
    when it ends (`finish`), and `close` forgets those that did not (failed, cancelled, never sent)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._turns: dict[int, tuple[Session, SessionRequest]] = {}

    def add(self, index: int, session: Session, node: SessionRequest) -> None:
        self._turns[index] = (session, node)

    def finish(self, index: int, output_ids: list[int]) -> None:
        turn = self._turns.pop(index, None)
        if turn is not None:
            turn[0].finish(turn[1], output_ids, self._clock())

    def close(self) -> None:
        for session, node in self._turns.values():
            session.forget(node, self._clock())
        self._turns.clear()

    async def __aenter__(self) -> SessionTurns:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class SessionBinder:
    """Turns /generate inputs with session_params into their sessions' requests."""

    def __init__(self, store: SessionStore, contexts: ModelContextCache, work: PromptWork,
                 abort: Callable[[str], bool]) -> None:
        self.store = store
        self._contexts = contexts
        self._work = work
        self._abort = abort

    async def bind(self, params: SessionParams | list[SessionParams], inputs: list[GenerationInput],
                   sampling_params: Any) -> SessionTurns:
        """Each input's whole prompt (its session's tokens, then its own) as its input_ids; HttpError when an
        input cannot continue its session (nothing is then left registered)."""
        per_input = params if isinstance(params, list) else [params] * len(inputs)
        samples = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        if any(isinstance(p, dict) and p.get("n") not in (None, 1) for p in samples):
            raise bad_request("sampling_params.n > 1 cannot be combined with session_params (a session request "
                              "is one generation)", "session_params")
        if len(per_input) != len(inputs):
            raise bad_request(f"session_params has {len(per_input)} entries but the batch has {len(inputs)} prompts",
                              "session_params")
        turns = SessionTurns(self.store.clock)
        try:
            for index, (want, generation) in enumerate(zip(per_input, inputs)):
                session, node, prompt_ids = await self._begin(want, generation)
                turns.add(index, session, node)
                generation.text, generation.input_ids = None, prompt_ids
                generation.session_pin = SessionPin(session.id, session.timeout_s)
        except BaseException:
            turns.close()
            raise
        return turns

    async def _begin(self, params: SessionParams, generation: GenerationInput) -> tuple[Session, SessionRequest, list[int]]:
        input_ids = generation.input_ids if generation.text is None else await self._tokenize(generation.text)
        bos = (await self._contexts.get()).model_info.get("bos_token_id")
        want = params.continuation()
        session = self.store.get(params.id)
        if want.replace:  # SGLang aborts the request it replaces (and its branches) and continues its output so far
            continued = session.continued(want)
            replaced = [continued] if continued is not None and continued.running else []
            await self._end(replaced + [node for node in session.replaced_by(continued, want) if node.running])
            session = self.store.get(params.id)  # closed meanwhile: 404
        node, prompt_ids, dropped = session.begin(generation.rid, want, list(input_ids or []),
                                                  generation.sampling_params.max_new_tokens,
                                                  bos if isinstance(bos, int) else None)
        for other in dropped:
            self._abort(other.rid)
        return session, node, prompt_ids

    async def _end(self, running: list[SessionRequest]) -> None:
        """Abort `running` and wait until each has ended (its output so far recorded)."""
        for node in running:
            self._abort(node.rid)
        try:
            await asyncio.wait_for(asyncio.gather(*(node.done.wait() for node in running)), REPLACE_WAIT_S)
        except asyncio.TimeoutError:
            raise HttpError(503, f"the requests this one replaces did not end within {REPLACE_WAIT_S:g} s",
                            param="session_params.replace", code="replace_timeout") from None

    async def _tokenize(self, text: str) -> list[int]:
        context = await self._contexts.get()
        if not context.token_texts.available:
            raise bad_request("a session request's text is tokenized by this front, which cannot read the model's "
                              "tokenizer.json; send input_ids", "text")
        context.budget.check_chars(len(text), "text")
        return await self._work.run(len(text) > TOKENIZE_INLINE_CHARS, context.token_texts.encode, text, True)
