"""The runtime's ZeroMQ authentication: every peer opens its connection with a handshake, and with
--api-key only one that proves it knows the key gets to send a single message.

The ROUTER runs ZeroMQ's PLAIN mechanism as a server (require_handshake): each connecting peer sends a
user name and a password in the ZMTP handshake (protocol.plain_credentials), and libzmq asks the ZAP
handler of its context (RFC 27: a REP socket bound at inproc://zeromq.zap.01) whether to let it in. This
is that handler: a thread that admits a password equal to the api_key (compared in constant time) and
refuses anything else, after which libzmq drops the connection with nothing of it queued, so a peer
without the key can make the server buffer nothing at all, whatever it sends (before, libzmq queued each
of its messages and the serve loop refused them one by one). Without --api-key it admits every PLAIN
peer: clients with a key and without one alike, as the runtime took both before. libzmq (4.3) refuses
every PLAIN peer while no handler is bound (tests/test_hostile_wire.py checks it), and the handler is
bound before the ROUTER anyway.

PLAIN sends the key as it is, like the HTTP front's bearer token: a network one does not trust needs a
tunnel (docs/safety.md).
"""

from __future__ import annotations

import hmac
import logging
import threading

import zmq

from sgl_lite.runtime.protocol import KEYLESS_USER, PLAIN_USER

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: one handler per ZeroMQ context
ZAP_DOMAIN = b"sgl_lite"
_POLL_MS = 100


class KeyAuthenticator:
    """Answers libzmq's ZAP requests for the context's sockets that use ZAP_DOMAIN: 200 for a PLAIN
    handshake whose password is the api_key (any PLAIN handshake without one), 400 for anything else.
    start() binds (before a ROUTER may take connections); stop() joins the thread, which closes its socket."""

    def __init__(self, context: zmq.Context, api_key: str | None) -> None:
        self._key = api_key.encode() if api_key is not None else None
        self._socket = context.socket(zmq.REP)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sgl-lite-zap", daemon=True)

    def start(self) -> None:
        self._socket.bind(ZAP_ENDPOINT)  # in the caller: a second handler on the context raises here
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        else:
            self._socket.close(linger=0)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(_POLL_MS):
                    self._socket.send_multipart(self.answer(self._socket.recv_multipart()))
        finally:
            self._socket.close(linger=0)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: [version, request id, status code, status text, user id, metadata]."""
        if len(request) < 6:
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _routing_id, mechanism, *credentials = request
        plain = version == b"1.0" and domain == ZAP_DOMAIN and mechanism == b"PLAIN" and len(credentials) == 2
        if plain and self._key is None:
            return [b"1.0", request_id, b"200", b"OK", credentials[0], b""]
        if plain and credentials[0] == PLAIN_USER and hmac.compare_digest(credentials[1], self._key or b""):
            return [b"1.0", request_id, b"200", b"OK", PLAIN_USER, b""]
        logger.debug("refused a ZeroMQ peer at %s (a %s handshake without the api_key)", address.decode(errors="replace"),
                     mechanism.decode(errors="replace"))
        return [b"1.0", request_id, b"400", b"no api_key" if credentials[:1] == [KEYLESS_USER] else b"wrong api_key", b"", b""]


def require_handshake(context: zmq.Context, sock: zmq.Socket, api_key: str | None) -> KeyAuthenticator:
    """Make `sock` (a ROUTER, before it binds) admit only peers that pass the PLAIN handshake (with
    `api_key` as their password, when given): starts the context's handler, which the caller stops."""
    authenticator = KeyAuthenticator(context, api_key)
    authenticator.start()
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    return authenticator
