"""The client's transport: one DEALER socket owned by one background I/O thread (torch-free).

User threads hand encoded messages to the thread through a queue and wake it through an inproc PAIR
socket (whose sending end is lock-protected); the thread routes every reply, by rid, to the sink
registered for that request (a function taking a Reply or an exception).

Liveness: while requests are pending and nothing has been heard from the runtime for
`health_interval` seconds, the thread sends a HealthReq; if nothing at all arrives within
`health_timeout` after that, every pending request's sink gets RuntimeUnavailableError.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from typing import Callable, Union

import msgspec
import zmq

from sgl_lite.runtime import protocol

logger = logging.getLogger(__name__)

_POLL_MS = 200
_CLOSE_LINGER_MS = 500
Item = Union[protocol.Reply, BaseException]  # what a request's sink receives
Sink = Callable[[Item], None]


class RuntimeRequestError(Exception):
    """The runtime answered with an error (`code`: bad_request, unauthorized, queue_full, aborted, ...)."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class RuntimeUnavailableError(ConnectionError):
    """The runtime did not answer in time: dead, unreachable, or hung."""


class ClientTransport:
    def __init__(self, address: str, api_key: str | None, health_interval: float, health_timeout: float) -> None:
        self.address = address
        self._api_key = api_key
        self._health_interval = health_interval
        self._health_timeout = health_timeout
        self._context = zmq.Context()
        self._pending: dict[str, tuple[Sink, bool]] = {}  # rid -> (sink, is a generate request)
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # None = stop
        wake_address = f"inproc://sgl-lite-client-wake-{uuid.uuid4().hex}"
        self._wake_recv = self._context.socket(zmq.PAIR)
        self._wake_recv.bind(wake_address)
        self._wake_send = self._context.socket(zmq.PAIR)
        self._wake_send.connect(wake_address)
        self.closed = False
        self._probe_ids = itertools.count()
        self._thread = threading.Thread(target=self._io_loop, name="sgl-lite-client-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from user threads

    def submit(self, rid: str, msg: protocol.Request, sink: Sink, *, is_generate: bool) -> None:
        """Register `sink` for the replies to `rid`, then send `msg`."""
        if self.closed:
            raise RuntimeRequestError("client is closed", "closed")
        with self._lock:
            if rid in self._pending:
                raise RuntimeRequestError(f"request id {rid!r} is already in flight on this client")
            self._pending[rid] = (sink, is_generate)
        self.send(msg)

    def send(self, msg: protocol.Request) -> None:
        self._outbox.put(protocol.encode(msg))
        self._wake()

    def is_pending(self, rid: str) -> bool:
        with self._lock:
            return rid in self._pending

    def abandon(self, rid: str) -> None:
        """Stop waiting for `rid` (timeout, a stream closed early); a generate is aborted on the runtime."""
        with self._lock:
            entry = self._pending.pop(rid, None)
        if entry is not None and entry[1] and not self.closed:
            self.send(protocol.AbortReq(rid, api_key=self._api_key))

    def close(self) -> None:
        """Abort the in-flight generate requests, fail every waiter, stop the I/O thread."""
        if self.closed:
            return
        self.closed = True
        with self._lock:
            pending, self._pending = self._pending, {}
        for rid, (sink, is_generate) in pending.items():
            if is_generate:
                self._outbox.put(protocol.encode(protocol.AbortReq(rid, api_key=self._api_key)))
            sink(RuntimeRequestError("client closed", "closed"))
        self._outbox.put(None)
        self._wake()
        self._thread.join(timeout=5.0)
        self._wake_send.close(linger=0)
        if not self._thread.is_alive():
            self._context.term()

    def _wake(self) -> None:
        with self._lock:
            try:
                self._wake_send.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already queued; the I/O thread drains the whole outbox

    # ------------------------------------------------------------------ the I/O thread

    def _io_loop(self) -> None:
        dealer = self._context.socket(zmq.DEALER)
        # A fixed routing id lets a reconnect (server restart, dropped connection) keep its requests.
        dealer.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        # Unbounded queue while the runtime is unreachable: sending never blocks this thread, so the
        # liveness check keeps running and fails the pending requests instead.
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.connect(self.address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        last_heard = time.monotonic()
        probe_sent_at: float | None = None
        probe_rid = ""
        try:
            while True:
                events = dict(poller.poll(_POLL_MS))
                if self._wake_recv in events:
                    while self._wake_recv.poll(0):
                        self._wake_recv.recv()
                if not self._flush_outbox(dealer):
                    return
                if dealer in events:
                    while dealer.poll(0):
                        self._route(dealer.recv(), probe_rid)
                    last_heard, probe_sent_at = time.monotonic(), None
                with self._lock:
                    has_pending = bool(self._pending)
                now = time.monotonic()
                if not has_pending:
                    last_heard, probe_sent_at = now, None
                elif probe_sent_at is None and now - last_heard >= self._health_interval:
                    probe_rid = f"health-probe-{next(self._probe_ids)}"
                    dealer.send(protocol.encode(protocol.HealthReq(probe_rid, api_key=self._api_key)), zmq.NOBLOCK)
                    probe_sent_at = now
                elif probe_sent_at is not None and now - probe_sent_at > self._health_timeout:
                    self._fail_all(RuntimeUnavailableError(
                        f"runtime at {self.address} is not responding: no answer to a health check within "
                        f"{self._health_timeout:g} s"))
                    last_heard, probe_sent_at = now, None
        finally:
            dealer.close(linger=_CLOSE_LINGER_MS)
            self._wake_recv.close(linger=0)

    def _flush_outbox(self, dealer: zmq.Socket) -> bool:
        """Send everything queued; False when close() asked the thread to stop."""
        while True:
            try:
                data = self._outbox.get_nowait()
            except queue.Empty:
                return True
            if data is None:
                return False
            dealer.send(data)

    def _route(self, data: bytes, probe_rid: str) -> None:
        try:
            reply = protocol.decode_reply(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            logger.warning("dropping an undecodable reply from %s: %s", self.address, e)
            return
        if reply.rid == probe_rid or (isinstance(reply, protocol.InfoReply) and reply.rid == ""):
            return  # liveness traffic (our probe's answer, the server's keepalive)
        with self._lock:
            entry = self._pending.get(reply.rid)
            if entry is not None and not isinstance(reply, protocol.TokenChunk):
                del self._pending[reply.rid]  # every other reply is the request's last
        if entry is None:
            logger.debug("dropping a reply for unknown request %r: %s", reply.rid, reply)
            return
        entry[0](reply)

    def _fail_all(self, error: RuntimeUnavailableError) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for sink, _ in pending.values():
            sink(error)
