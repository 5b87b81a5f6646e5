"""The HTTP API key (`Authorization: Bearer KEY`, compared in constant time), checked twice: by the
request guard before it reads a body (so a caller without the key cannot make the server buffer one),
and by each protected route (the routes' own contract, whatever middleware runs)."""

from __future__ import annotations

import hmac

from sgl_lite.http.errors import HttpError

OPEN_PATHS = frozenset({"/health"})  # routes that need no key
ADMIN_PATHS = frozenset({"/abort_request"})  # routes that take the admin key (--admin-api-key) too


def bearer_key_matches(authorization: str, api_key: str) -> bool:
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def api_key_error() -> HttpError:
    return HttpError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
