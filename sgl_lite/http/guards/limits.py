"""What one HTTP client may cost the front: body size, read times, fan-out, chat length.

- `RequestGuard` (ASGI middleware) refuses a missing or wrong API key (401) before anything else, then
  reads each request body itself, up to `max_request_body_bytes` (413 past it, at once when
  Content-Length says so) and within BODY_READ_TIMEOUT_S (408), and hands it to the app. Reading the
  body here, once, is what FastAPI would do anyway. On /abort_request the admin key passes too, and
  every request it lets through carries its caller (request_owner.CURRENT_CALLER).
- `guarded_h11_protocol` closes a connection whose request headers are not complete within
  HEADER_READ_TIMEOUT_S of its opening (or of its previous response): uvicorn itself only times out
  idle keep-alive connections, and a header sent a byte at a time (slowloris) would hold a
  connection forever.
- `parse_body` validates a JSON body against its pydantic model with pydantic's own parser (which
  refuses lone surrogates) off the event loop when the body is large, so one big body does not stall
  every other user; integers wider than 64 bits are refused with the field named.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol

from sgl_lite.http.errors import HttpError, bad_request
from sgl_lite.http.guards.api_key import ADMIN_PATHS, OPEN_PATHS, api_key_error, bearer_key_matches
from sgl_lite.http.guards.request_owner import CURRENT_CALLER, caller_of

HEADER_READ_TIMEOUT_S = 10.0
BODY_READ_TIMEOUT_S = 60.0
# Bodies larger than this are parsed on a worker thread; smaller ones inline (a thread hop costs more).
OFFLOAD_PARSE_BYTES = 64 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_LONG_DIGITS = re.compile(rb"\d{19,}")

Model = TypeVar("Model", bound=BaseModel)
T = TypeVar("T")


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP front's limits; the flags of the same names (server_args.py) set them."""

    max_request_body_bytes: int = 32 * 1024 * 1024
    max_chat_messages: int = 4096
    max_request_fanout: int = 256


class RequestGuard:
    """ASGI middleware: a bounded, timed read of the request body (see the module docstring)."""

    def __init__(self, app: Any, max_body_bytes: int, body_timeout_s: float = BODY_READ_TIMEOUT_S,
                 api_key: str | None = None, admin_api_key: str | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.api_key = api_key
        self.admin_api_key = admin_api_key  # also accepted on ADMIN_PATHS

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        authorization = headers.get(b"authorization", b"")
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS:  # before any body is read
            keys = [self.api_key]
            if self.admin_api_key is not None and scope.get("path") in ADMIN_PATHS:
                keys.append(self.admin_api_key)
            if not any(bearer_key_matches(authorization.decode("latin-1"), key) for key in keys):
                error = api_key_error()
                await self._refuse(send, error.status, error.message, error.code)
                return
        CURRENT_CALLER.set(caller_of(scope, authorization))  # whose generations this request starts
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(send, 413, f"request body of {int(declared)} bytes exceeds --max-request-body-bytes "
                                          f"{self.max_body_bytes}", "body_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.body_timeout_s) as timer:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    await self._refuse(send, 413, f"request body exceeds --max-request-body-bytes {self.max_body_bytes}",
                                       "body_too_large")
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if timer.cancelled_caught:
            await self._refuse(send, 408, f"request body not received within {self.body_timeout_s:g} s", "timeout")
            return
        body = b"".join(chunks)
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send: Any, status: int, message: str, code: str) -> None:
        payload = json.dumps(HttpError(status, message, code=code).body()).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def guarded_h11_protocol(header_timeout_s: float = HEADER_READ_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's headers (slowloris)."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._cycle_when_armed:  # the next request's headers are complete
                self._header_deadline.cancel()

        def connection_lost(self, exc: Exception | None) -> None:
            self._header_deadline.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            previous = getattr(self, "_header_deadline", None)
            if previous is not None:
                previous.cancel()
            self._cycle_when_armed = self.cycle
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            if self.cycle is self._cycle_when_armed and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


async def parse_body(request: Request, model: type[Model]) -> Model:
    """The body as `model`; 400 (through the validation handler) for bad JSON, lone surrogates,
    wrong fields, or an integer outside the signed 64-bit range."""
    raw = await request.body()
    return await off_loop_if(len(raw) > OFFLOAD_PARSE_BYTES, _parse, raw, model)


async def off_loop_if(large: bool, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), on a worker thread when `large` (the event loop serves everyone else meanwhile)."""
    return await anyio.to_thread.run_sync(fn, *args) if large else fn(*args)


def _parse(raw: bytes, model: type[Model]) -> Model:
    try:
        parsed = model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in e.errors()]) from None
    # Walk the model only when the raw text holds a run of 19+ digits (a 64-bit bound needs 19).
    where = _wide_int(parsed.model_dump()) if _LONG_DIGITS.search(raw) else None
    if where is not None:
        raise bad_request(f"{where}: integers must fit in 64 bits (signed)", where.split(".")[0].split("[")[0])
    return parsed


def _wide_int(value: Any) -> str | None:
    """The path of the first integer outside [-2**63, 2**63 - 1] in `value`, walked without recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, int) and not isinstance(node, bool):
            if not INT64_MIN <= node <= INT64_MAX:
                return path or "body"
        elif isinstance(node, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(node))
    return None
