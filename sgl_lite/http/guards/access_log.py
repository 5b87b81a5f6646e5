"""The access log: one line per HTTP request, refused ones included, on the logger `sgl_lite.http.access`.

`AccessLog` is the outermost ASGI middleware, so it sees every request, also those the request guard
refuses before any route runs (401, 408, 413): when it ends it logs the method, path, status, latency
(until the response's last byte, streams included) and request id. The id is the caller's
`X-Request-Id` header when it is a plain token (letters, digits, `._:-`, at most MAX_REQUEST_ID_CHARS),
else a new one; the response carries it back in `X-Request-Id`. With `--log-requests` the line also
holds the request body, cut to LOGGED_BODY_CHARS characters (SGLang's --log-requests-level 2 bound).
Everything a client chose (path, body) is written escaped, so it cannot forge log lines.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

logger = logging.getLogger("sgl_lite.http.access")

MAX_REQUEST_ID_CHARS = 128
LOGGED_BODY_CHARS = 2048
MAX_LOGGED_PATH_CHARS = 512
_PLAIN_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")


def escaped(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, with control and other non-printable characters escaped."""
    cut = text[:limit]
    out = cut if cut.isprintable() else cut.encode("unicode_escape").decode("ascii")
    return out + ("..." if len(text) > limit else "")


class AccessLog:
    """ASGI middleware writing the access line of each HTTP request (see the module docstring)."""

    def __init__(self, app: Any, log_bodies: bool = False) -> None:
        self.app = app
        self.log_bodies = log_bodies

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        given = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _PLAIN_ID.fullmatch(given) else uuid.uuid4().hex
        status: list[int] = []
        body: list[bytes] = []
        kept = 0

        async def reading() -> dict[str, Any]:
            nonlocal kept
            message = await receive()
            if self.log_bodies and message["type"] == "http.request" and kept < 4 * LOGGED_BODY_CHARS:
                chunk = message.get("body", b"")[: 4 * LOGGED_BODY_CHARS - kept]  # UTF-8: at most 4 bytes a character
                body.append(chunk)
                kept += len(chunk)
            return message

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, reading, sending)
        finally:
            # No response started: the app raised, and the server answers 500.
            self._write(scope, status[0] if status else 500, time.monotonic() - started, request_id, body)

    def _write(self, scope: dict[str, Any], status: int, seconds: float, request_id: str, body: list[bytes]) -> None:
        line = (f"{scope.get('method', '-')} {escaped(scope.get('path', ''), MAX_LOGGED_PATH_CHARS)} {status} "
                f"{seconds * 1000:.1f}ms request_id={request_id}")
        if self.log_bodies:
            text = b"".join(body).decode("utf-8", errors="replace")
            line += f" body={escaped(text, LOGGED_BODY_CHARS)}"
        logger.info("%s", line)
