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
The DEALER opens its connection with the runtime's handshake, with the api_key if it has one
(use_api_key); a runtime that refuses the key (or wants one this client lacks) fails every pending
request with code "unauthorized" at once.
When an established connection is lost, every pending request fails at once with
RuntimeUnavailableError: their replies will not come (a dead runtime sends none; a live one aborts the
requests of a peer it cannot reach). The generate requests among them are aborted as well, so that a
runtime that was only stopped stops working for nobody once it resumes and the client reconnects.
While there is no connection (never made, or lost), pending requests fail once they have waited
`health_timeout` s for one. A runtime whose process lives while its scheduler loop hangs keeps
answering heartbeats: only the client's per-request `timeout` ends that wait.

Nothing outlives the requests it was for. Whenever pending requests fail for want of a runtime, the
DEALER (and whatever it still queued for them: requests nobody waits for, which a runtime coming back
would otherwise run for nobody, and which pile up without bound while it stays away) is closed and a
new one, with the same routing id, connects in its place; it carries only the aborts still owed
(at most _MAX_OWED_ABORTS, until a connection takes them). close(), a RuntimeClient dropped without
close(), or the I/O thread ending for any reason fail every waiter exactly once, and the thread closes
every socket and the ZeroMQ context itself.
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
from sgl_lite.runtime.client.errors import RuntimeRequestError, RuntimeUnavailableError
from sgl_lite.runtime.client.wire import encode_request, heartbeat_milliseconds, use_api_key

logger = logging.getLogger(__name__)

_POLL_MS = 200
_CLOSE_LINGER_MS = 500
# Aborts kept for requests failed while the runtime was unreachable, to deliver once it is back; the
# oldest are dropped past this (the runtime also aborts the requests of a client that is gone).
_MAX_OWED_ABORTS = 65_536
# The monitor reports only what changes the link's state (not the TCP-level connects and retries), and
# the runtime's refusal of this client's api_key in the handshake.
_LINK_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
Item = Union[protocol.Reply, BaseException]  # what a request's sink receives
Sink = Callable[[Item], None]


class ClientTransport:
    def __init__(self, address: str, api_key: str | None, health_interval: float, health_timeout: float) -> None:
        from sgl_lite.runtime.client.discovery import check_zmq_address

        check_zmq_address(address)
        self.address = address
        if api_key and len(api_key.encode()) > protocol.MAX_API_KEY_BYTES:
            raise ValueError(f"api_key is longer than {protocol.MAX_API_KEY_BYTES} bytes")
        self._api_key = api_key or None  # the password of the connection's handshake (use_api_key)
        self._health_interval = health_interval
        self._health_timeout = health_timeout
        self._context = zmq.Context()
        # A fixed routing id, kept by every DEALER this client makes: after a reconnect the runtime's ROUTER
        # hands it over to the new connection, so what this client sends then is still its own.
        self._identity = uuid.uuid4().bytes
        # Made and connected here, so that an address ZeroMQ refuses raises in the caller at once; the I/O
        # thread owns the sockets from its start on (Thread.start is the memory barrier ZeroMQ asks for).
        try:
            self._dealer, self._monitor = self._connect()
        except zmq.ZMQError as e:
            self._context.term()
            raise ValueError(f"cannot connect to runtime address {address!r}: {e.strerror}") from None
        self._pending: dict[str, tuple[Sink, bool]] = {}  # rid -> (sink, is a generate request)
        self._aborts_claimed: set[str] = set()  # pending rids whose abort was sent (claim_abort)
        self._refusal: str | None = None  # why the runtime refused the last handshake (until one succeeds)
        self._owed_aborts: dict[str, None] = {}  # rids to abort once a connection takes them (I/O thread only)
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
        if len(rid) > protocol.MAX_RID_CHARS:
            raise RuntimeRequestError(f"request id of {len(rid)} characters is longer than {protocol.MAX_RID_CHARS}")
        data = encode_request(msg)
        with self._lock:  # under the lock that close() takes: no entry can be added after it failed them all
            if self.closed:
                raise RuntimeRequestError("client is closed", "closed")
            if self._refusal is not None:  # libzmq does not retry a handshake refused for its key
                raise RuntimeRequestError(self._refusal, "unauthorized")
            if rid in self._pending:
                raise RuntimeRequestError(f"request id {rid!r} is already in flight on this client")
            self._pending[rid] = (sink, is_generate)
        self._send_encoded(data)

    def send(self, msg: protocol.Request) -> None:
        self._send_encoded(encode_request(msg))

    def _send_encoded(self, data: bytes) -> None:
        if self.closed:
            return  # close() failed and aborted everything in flight: nothing is sent after it
        self._outbox.put(data)
        self._wake()

    def is_pending(self, rid: str) -> bool:
        with self._lock:
            return rid in self._pending

    def claim_abort(self, rid: str) -> bool:
        """True once per pending request, for the caller that is to send its abort: a request whose abort
        is on its way stays pending until the runtime's answer, and must not be aborted (or counted) twice."""
        with self._lock:
            self._aborts_claimed.intersection_update(self._pending)  # forget requests that ended
            if rid not in self._pending or rid in self._aborts_claimed:
                return False
            self._aborts_claimed.add(rid)
            return True

    def pending_generates(self) -> list[str]:
        with self._lock:
            return [rid for rid, (_, is_generate) in self._pending.items() if is_generate]

    def abandon(self, rid: str) -> None:
        """Stop waiting for `rid` (timeout, a stream closed early); a generate is aborted on the runtime."""
        with self._lock:
            entry = self._pending.pop(rid, None)
        if entry is not None and entry[1]:
            self.send(protocol.AbortReq(rid))

    def close(self) -> None:
        """Abort the in-flight generate requests, fail every waiter, stop the I/O thread (which closes
        the sockets and the context)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            pending, self._pending = self._pending, {}
        for rid, (sink, is_generate) in pending.items():
            if is_generate:
                self._outbox.put(protocol.encode(protocol.AbortReq(rid)))
            sink(RuntimeRequestError("client closed", "closed"))
        self._outbox.put(None)
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def _wake(self) -> None:
        with self._lock:
            if self._wake_send.closed:
                return  # the I/O thread has ended: nothing is sent any more
            try:
                self._wake_send.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already queued; the I/O thread drains the whole outbox

    # ------------------------------------------------------------------ the I/O thread

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket]:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self._identity)
        # Unbounded queue while the runtime is unreachable: sending never blocks this thread, so the
        # liveness check keeps running and fails the pending requests instead.
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.setsockopt(zmq.IPV6, 1)  # IPv6 runtimes too (IPv4 ones as before)
        dealer.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_milliseconds(self._health_interval))
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_milliseconds(self._health_timeout))
        use_api_key(dealer, self._api_key)
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
        poller = self._poller()
        link_up = False  # a ZMTP handshake succeeded and the connection has not been lost since
        waiting_since: float | None = None  # since when pending requests wait for a connection
        ended_by = "the client was closed"
        try:
            while True:
                events = dict(poller.poll(_POLL_MS))
                if self._wake_recv in events:
                    while self._wake_recv.poll(0):
                        self._wake_recv.recv()
                if not self._flush_outbox(self._dealer):
                    return
                # Replies before link events: what arrived before a disconnect is still delivered.
                self._drain_replies(self._dealer)
                if self._monitor in events:
                    link_up, lost = self._follow_link(link_up)
                    if lost:
                        poller = self._reconnect()
                with self._lock:
                    has_pending = bool(self._pending)
                now = time.monotonic()
                if link_up or not has_pending:
                    waiting_since = None
                elif waiting_since is None:
                    waiting_since = now
                elif now - waiting_since > self._health_timeout:
                    # Never sent on a connection, so nothing to abort: the new DEALER drops them unsent.
                    self._fail_all(f"no connection to it within {self._health_timeout:g} s", owe_aborts=False)
                    poller = self._reconnect()
                    waiting_since = None
        except BaseException as e:
            ended_by = f"its I/O thread failed: {e!r}"
            logger.exception("the client of %s stopped", self.address)
            raise
        finally:
            self._release(ended_by)

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        for sock in (self._dealer, self._monitor, self._wake_recv):
            poller.register(sock, zmq.POLLIN)
        return poller

    def _close_link(self, linger_ms: int) -> None:
        if self._dealer.closed:
            return  # _reconnect() closed it and failed to make the next one
        self._dealer.disable_monitor()
        self._monitor.close(linger=0)
        self._dealer.close(linger=linger_ms)

    def _reconnect(self) -> zmq.Poller:
        """Replace the DEALER, dropping what it still queued for failed requests; the new one carries
        the aborts still owed. Returns the poller over the new sockets."""
        self._close_link(linger_ms=0)
        self._dealer, self._monitor = self._connect()
        for rid in self._owed_aborts:
            self._send(self._dealer, protocol.encode(protocol.AbortReq(rid)))
        return self._poller()

    def _release(self, ended_by: str) -> None:
        """The I/O thread's last act: fail whoever still waits, close every socket and the context."""
        with self._lock:
            self.closed = True
            pending, self._pending = self._pending, {}
        error = RuntimeRequestError(f"client closed: {ended_by}", "closed")
        for sink, _ in pending.values():
            sink(error)
        self.link_up = False
        self._close_link(linger_ms=_CLOSE_LINGER_MS)  # time to deliver close()'s aborts
        self._wake_recv.close(linger=0)
        with self._lock:
            self._wake_send.close(linger=0)
        self._context.term()

    def _follow_link(self, link_up: bool) -> tuple[bool, bool]:
        """Apply the monitor's events: (whether the link is up afterwards, whether an established
        connection was lost, failing its requests)."""
        lost = False
        while self._monitor.poll(0):
            message = recv_monitor_message(self._monitor)
            event = message["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH or (
                    event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and message["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
                # What waits for the connection now is refused, and so is every later request until a
                # handshake succeeds (libzmq does not retry a refused key), rather than left to time out for
                # want of a runtime.
                why = ("the runtime speaks another handshake (not an sgl_lite runtime of this version?)"
                       if event != zmq.EVENT_HANDSHAKE_FAILED_AUTH else "the runtime refused this client's api_key"
                       if self._api_key else "the runtime requires an api_key and this client has none")
                with self._lock:
                    self._refusal = why
                self._refuse_all(protocol.ErrorReply("", why, "unauthorized"))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                with self._lock:
                    self._refusal = None
                link_up = True
                self._owed_aborts.clear()  # queued on this DEALER before its handshake: they go out now
            elif event == zmq.EVENT_DISCONNECTED:
                # Also reported for a handshake that failed (e.g. timed out against a stopped process);
                # only losing an established connection strands requests already sent on it.
                if link_up:
                    self._drain_replies(self._dealer)
                    self._fail_all("the connection was lost (the process exited or dropped it, or sent "
                                   f"no ZMTP heartbeat for {self._health_timeout:g} s)", owe_aborts=True)
                    lost = True
                    link_up = False
                    break  # the DEALER and its monitor are replaced: their further events do not matter
        self.link_up = link_up
        return link_up, lost

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
            self._send(dealer, data)

    def _send(self, dealer: zmq.Socket, data: bytes) -> None:
        try:
            dealer.send(data, zmq.NOBLOCK)  # (the queue is unbounded: only a DEALER without a pipe refuses)
        except zmq.Again:
            # libzmq drops the pipe of a connection whose handshake the runtime refused, and does not retry:
            # blocking would hang this thread. What waits for this message is refused by that handshake's
            # event (_follow_link), or was already (submit raises then).
            logger.debug("dropped a message for %s: no connection takes it", self.address)

    def _route(self, data: bytes) -> None:
        try:
            reply = protocol.decode_reply(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            logger.warning("dropping an undecodable reply from %s: %s", self.address, e)
            return
        if isinstance(reply, protocol.InfoReply) and reply.rid == "":
            return  # the server's keepalive (it finds vanished clients by sending to them)
        if isinstance(reply, protocol.ErrorReply) and reply.rid == "" and reply.code == "bad_request":
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
        """The runtime refused our api_key in the handshake, or a message it could not tell the request of
        (rid "": our framing, a client and a server of different wire versions). Every pending request
        has the same key and framing, so every one of them is refused, rather than left to wait out the timeout."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for sink, _ in pending.values():
            sink(reply)

    def _fail_all(self, reason: str, *, owe_aborts: bool) -> None:
        """Every pending request gets RuntimeUnavailableError. With `owe_aborts` (they were sent on a
        connection now lost) the generate requests among them are to be aborted too, so that a runtime
        which was stopped rather than dead does not finish them for nobody once it runs again."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        logger.warning("runtime at %s is not responding: %s; failing %d pending request(s)",
                       self.address, reason, len(pending))
        error = RuntimeUnavailableError(f"runtime at {self.address} is not responding: {reason}")
        for rid, (sink, is_generate) in pending.items():
            if is_generate and owe_aborts:
                self._owed_aborts[rid] = None
            sink(error)
        while len(self._owed_aborts) > _MAX_OWED_ABORTS:
            del self._owed_aborts[next(iter(self._owed_aborts))]
