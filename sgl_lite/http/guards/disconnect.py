"""Abort a generation when its HTTP client goes away before the response starts.

Starlette does not cancel a handler when its client disconnects: a non-streaming request (or a
streaming one still waiting for its first event, which sse.py computes before the headers) would
run to its end for nobody. `cancel_on_disconnect` runs the handler's work beside a watch on the ASGI
receive channel; the request body has already been read, so the next message there is the
disconnect. Cancelling the work closes its RuntimeClient streams, which aborts the runtime requests.
Once a streaming response has started, StreamingResponse watches for the disconnect itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

from sgl_lite.http.errors import HttpError

T = TypeVar("T")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise HttpError(499, "the client disconnected before the response", code="cancelled")


async def _disconnected(request: Request) -> Any:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return message
