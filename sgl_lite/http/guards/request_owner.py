"""Whose generation is whose, for /abort_request: a caller may abort the requests it started; `abort_all`
and another caller's request need the admin key (`--admin-api-key`, SGLang's flag).

The front has no accounts, so "a caller" is what it can tell of an HTTP request: the client's network
address (without the port: an abort comes on a connection of its own while the generation's connection
waits for its answer) and the `Authorization` header it sent (kept as a digest, not the key). Callers
behind one proxy that share its address and key (a gateway, sglang-router) are one caller to the front.

The guard (limits.RequestGuard) sets CURRENT_CALLER for the whole handling of each HTTP request (context
variables follow the tasks and streams the handler starts); RequestRunner records the caller of each
generation under its rid while it runs (`RequestOwners.running`).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

from sgl_lite.http.errors import HttpError

CURRENT_CALLER: ContextVar[str | None] = ContextVar("sgl_lite_http_caller", default=None)


def caller_of(scope: dict[str, Any], authorization: bytes) -> str:
    """The caller of an HTTP request (its ASGI scope and Authorization header)."""
    client = scope.get("client")
    host = str(client[0]) if client else ""
    return f"{host} {hashlib.sha256(authorization).hexdigest()}"


class RequestOwners:
    """The caller of each running generation, by rid (only while it runs)."""

    def __init__(self) -> None:
        self._owners: dict[str, tuple[str, object]] = {}

    @contextmanager
    def running(self, rid: str, caller: str | None) -> Iterator[None]:
        """Record `caller` as the owner of `rid` for the duration of the block. A rid already running keeps
        its owner (the runtime refuses the second request with that rid anyway)."""
        mark = object()
        if caller is not None:
            self._owners.setdefault(rid, (caller, mark))
        try:
            yield
        finally:
            if self._owners.get(rid, (None, None))[1] is mark:
                del self._owners[rid]

    def owner(self, rid: str) -> str | None:
        entry = self._owners.get(rid)
        return entry[0] if entry is not None else None


def admin_required(what: str, param: str, admin_api_key: str | None) -> HttpError:
    """403 for an abort beyond the caller's own requests."""
    how = ("send 'Authorization: Bearer <admin key>'" if admin_api_key is not None
           else "this server has no --admin-api-key, so nobody may")
    return HttpError(403, f"{what} needs the admin key (--admin-api-key): {how}", param=param, code="forbidden")


def rids_to_abort(rid: str, abort_all: bool, *, caller: str | None, admin: bool, owners: RequestOwners,
                  in_flight: list[str], admin_api_key: str | None) -> list[str]:
    """What one /abort_request may end: its own request (by rid); with the admin key, any request or, with
    abort_all, every one. HttpError 403 for more without the admin key. A rid that is not running (never
    started, or finished) is nobody's: it aborts nothing."""
    if abort_all:
        if not admin:
            raise admin_required("abort_all (every caller's requests)", "abort_all", admin_api_key)
        return in_flight
    if not admin and rid in in_flight and owners.owner(rid) != caller:
        raise admin_required(f"rid {rid!r}: a request another caller started; aborting it", "rid", admin_api_key)
    return [rid]
