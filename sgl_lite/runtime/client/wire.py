"""What the client puts on its socket: the handshake's credentials, heartbeat option values, and a request's
bytes, with what msgpack cannot carry named as the caller's error (torch-free)."""

from __future__ import annotations

import zmq

from sgl_lite.runtime import protocol
from sgl_lite.runtime.client.errors import RuntimeRequestError


def use_api_key(sock: zmq.Socket, api_key: str | None) -> None:
    """Make `sock` (before it connects) open its connection with the runtime's handshake: ZeroMQ's PLAIN
    mechanism, with `api_key` as its password if given (protocol.plain_credentials, server/zap.py)."""
    user, password = protocol.plain_credentials(api_key)
    sock.setsockopt(zmq.PLAIN_USERNAME, user)
    sock.setsockopt(zmq.PLAIN_PASSWORD, password)


def encode_request(msg: protocol.Request) -> bytes:
    """The wire bytes of `msg`; what msgpack cannot carry is the caller's error, named here."""
    try:
        return protocol.encode(msg)
    except OverflowError:
        raise RuntimeRequestError("the request holds an integer outside the 64-bit range") from None
    except UnicodeEncodeError as e:
        raise RuntimeRequestError(f"the request holds text that is not valid Unicode ({e.reason}: a lone surrogate)") from None
    except RecursionError:  # the server could not decode it either (and could not even tell whose it is)
        raise RuntimeRequestError("the request is nested too deeply to encode") from None


def heartbeat_milliseconds(seconds: float) -> int:
    """libzmq's heartbeat options are whole milliseconds in a C int; 0 would switch heartbeats off."""
    return min(max(1, round(seconds * 1000)), 2**31 - 1)
