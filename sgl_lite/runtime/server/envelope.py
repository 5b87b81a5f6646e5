"""What the server may read of ANY incoming message before trusting it: a rid to answer.

A malformed or hostile message still gets one answer (with --api-key, only from a peer that passed the
handshake with the key: zap.py). The envelope is a lenient view of the msgpack map (unknown fields
ignored, any type accepted, nesting too deep = no envelope), read before the full decode, and only a rid
that obeys the wire's own rule (non-empty, at most MAX_RID_CHARS) is ever echoed back.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec

from sgl_lite.runtime import protocol

REQUEST_TYPES = tuple(t.__name__ for t in typing.get_args(protocol.Request))  # the wire tags


class Envelope(msgspec.Struct):
    type: Any = None
    rid: Any = None


def read_envelope(payload: bytes) -> Envelope | None:
    try:
        return msgspec.msgpack.decode(payload, type=Envelope)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):  # RecursionError: nested too deeply
        return None


def echoable_rid(envelope: Envelope | None) -> str:
    """The rid a reply to this message may carry back ("" when it has none the wire would accept)."""
    rid = envelope.rid if envelope is not None else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= protocol.MAX_RID_CHARS else ""


def describe_invalid(envelope: Envelope | None, error: Exception) -> str:
    if envelope is None:
        return f"undecodable request (expected a msgpack map with a 'type' field): {error}"
    if isinstance(envelope.type, str) and envelope.type not in REQUEST_TYPES:
        return f"unknown message type {envelope.type!r}; expected one of {', '.join(REQUEST_TYPES)}"
    return f"invalid request: {error}"
