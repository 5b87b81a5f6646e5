"""Server-sent events as OpenAI and SGLang stream them: `data: {json}` events, then `data: [DONE]`; or, as
OpenAI's Responses API streams them (`named_events`), `event: <type>` before each `data:` and no `[DONE]`
(the stream ends with its `response.completed` event).

The first event is computed before the response starts, so a request the runtime rejects at once
(bad field, full queue) still gets its proper HTTP status instead of a 200 with an error event.
Errors after that are sent as one `data: {"error": ...}` event. Leaving the stream early (the
client disconnected) closes the event source, which aborts its runtime requests.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse

from sgl_lite.http.errors import HttpError, from_runtime_error

logger = logging.getLogger(__name__)


def _event(payload: dict[str, Any] | str, name: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return (f"event: {name}\n" if name else "").encode() + f"data: {data}\n\n".encode()


async def sse_response(events: AsyncIterator[dict[str, Any]], on_end: Callable[[str], None], *,
                       named_events: bool = False) -> StreamingResponse:
    """Stream `events`; `on_end(outcome)` is called once with success, an error outcome or cancelled.

    `named_events`: each event is named by its `type` (an error event: `error`), and no `[DONE]` follows."""

    def event(payload: dict[str, Any]) -> bytes:
        return _event(payload, str(payload.get("type", "error")) if named_events else None)

    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await _close(events)
        raise

    async def body() -> AsyncIterator[bytes]:
        outcome = "cancelled"
        try:
            if first is not None:
                yield event(first)
            async for payload in events:
                yield event(payload)
            outcome = "success"
        except Exception as e:
            error = from_runtime_error(e)
            if not isinstance(e, HttpError):
                logger.exception("stream failed")
            outcome = error.outcome
            yield event(error.body())
        finally:
            await _close(events)
            on_end(outcome)
        if not named_events:
            yield _event("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _close(events: AsyncIterator[Any]) -> None:
    with anyio.CancelScope(shield=True):
        await events.aclose()  # type: ignore[attr-defined]
