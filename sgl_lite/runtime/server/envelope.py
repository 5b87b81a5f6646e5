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


# What decoding a hostile message may raise: besides msgspec's own errors, RecursionError (nested too
# deeply) and UnicodeDecodeError (a string that is not UTF-8). Each is the sender's fault (bad_request).
DECODE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError, RecursionError, UnicodeDecodeError)


def read_envelope(payload: bytes) -> Envelope | None:
    try:
        return msgspec.msgpack.decode(payload, type=Envelope)
    except DECODE_ERRORS:
        return None


def echoable_rid(envelope: Envelope | None) -> str:
    """The rid a reply to this message may carry back ("" when it has none the wire would accept)."""
    rid = envelope.rid if envelope is not None else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= protocol.MAX_RID_CHARS else ""


def describe_invalid(envelope: Envelope | None, error: Exception) -> str:
    if envelope is None:
        if isinstance(error, UnicodeDecodeError):  # its type or rid is not UTF-8, so none is echoed
            return f"undecodable request: a string is not valid UTF-8 ({error.reason} at byte {error.start} of it)"
        return f"undecodable request (expected a msgpack map with a 'type' field): {error}"
    if isinstance(envelope.type, str) and envelope.type not in REQUEST_TYPES:
        return f"unknown message type {envelope.type!r}; expected one of {', '.join(REQUEST_TYPES)}"
    if isinstance(error, UnicodeDecodeError):
        return f"invalid request: a string is not valid UTF-8 ({error.reason} at byte {error.start} of it)"
    return f"invalid request: {error}"
