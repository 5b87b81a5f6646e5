"""The client's transport: one DEALER socket owned by one background I/O thread (torch-free).

User threads hand encoded messages to the thread through a queue and wake it through an inproc PAIR
socket (whose sending end is lock-protected); the thread routes every reply, by rid, to the sink
registered for that request (a function taking a Reply or an exception).

Liveness never depends on the runtime's scheduler loop (which reads its socket only between steps,
and one step can take a long time). It comes from ZeroMQ itself:
- ZMTP heartbeats: the DEALER sends a PING every `health_interval` s and libzmq drops the connection
  when nothing (not even the PONG) arrives within `health_timeout` s. The runtime's libzmq I/O thread
  answers PINGs without its application thread (and without the GIL), so a runtime inside a long
  step stays connected; one whose process is stopped (SIGSTOP) or whose host is unreachable does not.
- A socket monitor on the DEALER reports the connection's handshake and its loss. A runtime process
  that exits (even by SIGKILL) has its socket closed by the OS, which libzmq sees at once.
When an established connection is lost, every pending request fails at once with
RuntimeUnavailableError: their replies will not come (a dead runtime sends none; a live one aborts the
requests of a peer it cannot reach). The generate requests among them are aborted as well, so that a
runtime that was only stopped stops working for nobody once it resumes and the DEALER reconnects.
While there is no connection (never made, or lost), pending requests fail once they have waited
`health_timeout` s for one. A runtime whose process lives while its scheduler loop hangs keeps
answering heartbeats: only the client's per-request `timeout` ends that wait.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Callable, Union

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from sgl_lite.runtime import protocol

logger = logging.getLogger(__name__)

_POLL_MS = 200
_CLOSE_LINGER_MS = 500
# The monitor reports only what changes the link's state (not the TCP-level connects and retries).
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
Item = Union[protocol.Reply, BaseException]  # what a request's sink receives
Sink = Callable[[Item], None]


class RuntimeRequestError(Exception):
    """The runtime answered with an error (`code`: bad_request, unauthorized, queue_full, aborted, ...)."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class RuntimeUnavailableError(ConnectionError):
    """The runtime is gone (its process exited or is stopped), cannot be reached, or did not answer a
    request within the client's `timeout`."""


class ClientTransport:
    def __init__(self, address: str, api_key: str | None, health_interval: float, health_timeout: float) -> None:
        from sgl_lite.runtime.client.discovery import check_zmq_address

        check_zmq_address(address)
        self.address = address
        self._api_key = api_key
        self._health_interval = health_interval
        self._health_timeout = health_timeout
        self._context = zmq.Context()
        # Made and connected here, so that an address ZeroMQ refuses raises in the caller at once; the I/O
        # thread owns the sockets from its start on (Thread.start is the memory barrier ZeroMQ asks for).
        try:
            self._dealer, self._monitor = self._connect()
        except zmq.ZMQError as e:
            self._context.term()
            raise ValueError(f"cannot connect to runtime address {address!r}: {e.strerror}") from None
        self._pending: dict[str, tuple[Sink, bool]] = {}  # rid -> (sink, is a generate request)
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # None = stop
        wake_address = f"inproc://sgl-lite-client-wake-{uuid.uuid4().hex}"
        self._wake_recv = self._context.socket(zmq.PAIR)
        self._wake_recv.bind(wake_address)
        self._wake_send = self._context.socket(zmq.PAIR)
        self._wake_send.connect(wake_address)
        self.closed = False
        # Whether the DEALER holds an established, heartbeat-live connection (written by the I/O thread).
        self.link_up = False
        self._thread = threading.Thread(target=self._io_loop, name="sgl-lite-client-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from user threads

    def submit(self, rid: str, msg: protocol.Request, sink: Sink, *, is_generate: bool) -> None:
        """Register `sink` for the replies to `rid`, then send `msg`."""
        if self.closed:
            raise RuntimeRequestError("client is closed", "closed")
        if len(rid) > protocol.MAX_RID_CHARS:
            raise RuntimeRequestError(f"request id of {len(rid)} characters is longer than {protocol.MAX_RID_CHARS}")
        data = _encode(msg)
        with self._lock:
            if rid in self._pending:
                raise RuntimeRequestError(f"request id {rid!r} is already in flight on this client")
            self._pending[rid] = (sink, is_generate)
        self._send_encoded(data)

    def send(self, msg: protocol.Request) -> None:
        self._send_encoded(_encode(msg))

    def _send_encoded(self, data: bytes) -> None:
        self._outbox.put(data)
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

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket]:
        dealer = self._context.socket(zmq.DEALER)
        # A fixed routing id: after a reconnect the runtime's ROUTER hands it over to the new connection,
        # so what this client sends then (the aborts of failed requests, new requests) is still its own.
        dealer.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        # Unbounded queue while the runtime is unreachable: sending never blocks this thread, so the
        # liveness check keeps running and fails the pending requests instead.
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.setsockopt(zmq.HEARTBEAT_IVL, _milliseconds(self._health_interval))
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, _milliseconds(self._health_timeout))
        monitor = dealer.get_monitor_socket(_LINK_EVENTS)  # before connect(): no event may be missed
        try:
            dealer.connect(self.address)
        except zmq.ZMQError:
            dealer.disable_monitor()
            monitor.close(linger=0)
            dealer.close(linger=0)
            raise
        return dealer, monitor

    def _io_loop(self) -> None:
        dealer, monitor = self._dealer, self._monitor
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        link_up = False  # a ZMTP handshake succeeded and the connection has not been lost since
        waiting_since: float | None = None  # since when pending requests wait for a connection
        try:
            while True:
                events = dict(poller.poll(_POLL_MS))
                if self._wake_recv in events:
                    while self._wake_recv.poll(0):
                        self._wake_recv.recv()
                if not self._flush_outbox(dealer):
                    return
                # Replies before link events: what arrived before a disconnect is still delivered.
                self._drain_replies(dealer)
                if monitor in events:
                    link_up = self._follow_link(monitor, dealer, link_up)
                with self._lock:
                    has_pending = bool(self._pending)
                now = time.monotonic()
                if link_up or not has_pending:
                    waiting_since = None
                elif waiting_since is None:
                    waiting_since = now
                elif now - waiting_since > self._health_timeout:
                    self._fail_all(dealer, f"no connection to it within {self._health_timeout:g} s")
                    waiting_since = None
        finally:
            dealer.disable_monitor()
            monitor.close(linger=0)
            dealer.close(linger=_CLOSE_LINGER_MS)
            self._wake_recv.close(linger=0)

    def _follow_link(self, monitor: zmq.Socket, dealer: zmq.Socket, link_up: bool) -> bool:
        """Apply the monitor's events; returns whether the link is up afterwards."""
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link_up = True
            elif event == zmq.EVENT_DISCONNECTED:
                # Also reported for a handshake that failed (e.g. timed out against a stopped process);
                # only losing an established connection strands requests already sent on it.
                if link_up:
                    self._drain_replies(dealer)
                    self._fail_all(dealer, "the connection was lost (the process exited or dropped it, or sent "
                                           f"no ZMTP heartbeat for {self._health_timeout:g} s)")
                link_up = False
        self.link_up = link_up
        return link_up

    def _drain_replies(self, dealer: zmq.Socket) -> None:
        while dealer.poll(0):
            self._route(dealer.recv())

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

    def _route(self, data: bytes) -> None:
        try:
            reply = protocol.decode_reply(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            logger.warning("dropping an undecodable reply from %s: %s", self.address, e)
            return
        if isinstance(reply, protocol.InfoReply) and reply.rid == "":
            return  # the server's keepalive (it finds vanished clients by sending to them)
        if isinstance(reply, protocol.ErrorReply) and reply.rid == "" and reply.code == "unauthorized":
            self._refuse_all(reply)
            return
        with self._lock:
            entry = self._pending.get(reply.rid)
            if entry is not None and not isinstance(reply, protocol.TokenChunk):
                del self._pending[reply.rid]  # every other reply is the request's last
        if entry is None:
            logger.debug("dropping a reply for unknown request %r: %s", reply.rid, reply)
            return
        entry[0](reply)

    def _refuse_all(self, reply: protocol.ErrorReply) -> None:
        """The server refused our api_key (it echoes no rid then): every pending request carries the
        same key, so every one of them is refused."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for sink, _ in pending.values():
            sink(reply)

    def _fail_all(self, dealer: zmq.Socket, reason: str) -> None:
        """Every pending request gets RuntimeUnavailableError; generate requests are also aborted, so
        that a runtime which was stopped rather than dead does not finish them for nobody once it runs
        again (the DEALER queues the aborts until it reconnects)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        logger.warning("runtime at %s is not responding: %s; failing %d pending request(s)",
                       self.address, reason, len(pending))
        error = RuntimeUnavailableError(f"runtime at {self.address} is not responding: {reason}")
        for rid, (sink, is_generate) in pending.items():
            if is_generate:
                dealer.send(protocol.encode(protocol.AbortReq(rid, api_key=self._api_key)))
            sink(error)


def _encode(msg: protocol.Request) -> bytes:
    """The wire bytes of `msg`; what msgpack cannot carry is the caller's error, named here."""
    try:
        return protocol.encode(msg)
    except OverflowError:
        raise RuntimeRequestError("the request holds an integer outside the 64-bit range") from None
    except UnicodeEncodeError as e:
        raise RuntimeRequestError(f"the request holds text that is not valid Unicode ({e.reason}: a lone surrogate)") from None
    except RecursionError:  # the server could not decode it either (and could not even tell whose it is)
        raise RuntimeRequestError("the request is nested too deeply to encode") from None


def _milliseconds(seconds: float) -> int:
    """libzmq's heartbeat options are whole milliseconds in a C int; 0 would switch heartbeats off."""
    return min(max(1, round(seconds * 1000)), 2**31 - 1)
