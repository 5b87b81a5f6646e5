"""The runtime process's front door: one ZeroMQ ROUTER socket in front of one RuntimeCore.

A single thread owns the socket and the core. Pure transport: every request goes through the
RuntimeCore's methods (submit, abort, step, flush_cache, stream_state), never the scheduler itself.
Each loop iteration reads every waiting message (non-blocking while the core has work, otherwise blocking up to
IDLE_POLL_MS so that shutdown requests are noticed), then runs one `core.step()` and replies to whoever asked for
each changed request: TokenChunk (streams), then Finished, or ErrorReply when the request was aborted (except by
its client's AbortReq: that one ends like a finished request, with the output so far and finish_reason
{"type": "abort"}, as SGLang's /abort_request does).

Request ids are chosen by clients, so the scheduler sees them prefixed with the client's ZeroMQ identity: two
clients may use the same rid, and a client can only abort its own requests. Every request gets one final message:
an AbortReq for one that ended before its final went out gets no answer of its own.

Disconnects: ROUTER cannot see them directly. The socket is ROUTER_MANDATORY, so sending to a vanished identity
raises EHOSTUNREACH, and sending to one that let --max-queued-replies-per-client replies pile up without reading
raises EAGAIN; the server then aborts all of that identity's requests and sends it nothing more until it reads
again. To notice a dead client before its request would have produced output, identities with requests in flight
get a keepalive (an InfoReply with rid "", which clients ignore) every KEEPALIVE_S seconds.

Liveness, the other way round, does not involve this thread: clients send ZMTP heartbeats (PINGs), which libzmq's
I/O thread answers while this thread is inside a scheduler step of any length, so a long step never makes a client
give up on the runtime. HealthReq, by contrast, is answered here, between steps: it tells that the runtime is ready
to serve, not merely alive.

Hostile input: with --api-key, only peers whose handshake carried the key get a message this far (zap.py). One
message is handled under a guard (_handle_guarded), so nothing it raises (a RecursionError decoding a deeply
nested message, a bug) ends the loop; it gets an ErrorReply.

Failures: a forward pass that raises costs only its batch's requests (the scheduler aborts them and names the
cause); an error building one reply costs only that request; anything else raising from a scheduler step aborts
every request in flight with the error, and the server keeps serving if the KV accounting still holds (else it
shuts down, telling every client why). SIGTERM / SIGINT end the loop after the current step: every request still
in flight gets ErrorReply("server shutting down", code "aborted") before the socket closes.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from sgl_lite.runtime import protocol
from sgl_lite.runtime.managers.request import ABORTED_BY_CLIENT, FinishKind, FinishReason, Req
from sgl_lite.runtime.managers.validation import QueueFullError
from sgl_lite.runtime.server.envelope import DECODE_ERRORS, describe_invalid, echoable_rid, read_envelope
from sgl_lite.runtime.server.pending_prompts import PendingPrompts
from sgl_lite.runtime.server.replies import InFlight, final_replies, replies_for
from sgl_lite.runtime.server.router_socket import RouterSocket, bind_router
from sgl_lite.runtime.server_args import ServerArgs

if TYPE_CHECKING:  # the core needs torch, which this module does not import at load time
    from sgl_lite.runtime.server.core import RuntimeCore

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100
PENDING_POLL_MS = 2  # while a long prompt is tokenized elsewhere and nothing else runs
GRAMMAR_POLL_MS = 5
MAX_MESSAGES_PER_STEP = 256  # so a flood of requests cannot starve running ones of steps
KEEPALIVE_S = 1.0
SHUTDOWN_LINGER_MS = 1000


def _wire_value(obj: Any) -> Any:
    """Encode hook: server info may hold paths, dtypes, enums; they travel as strings."""
    return str(obj)


class RuntimeServer:
    def __init__(self, core: RuntimeCore, args: ServerArgs, context: zmq.Context | None = None) -> None:
        self._core = core
        self._args = args
        # A context of its own unless given one: with --api-key its ZAP handler is the context's only one
        # (zap.py), so two servers in one process (tests) must not share the global context.
        self._owned_context = context is None
        self._context = context or zmq.Context()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_wire_value)
        self._router: RouterSocket | None = None  # while bound
        self._inflight: dict[str, InFlight] = {}
        self._pending = PendingPrompts()  # long texts being tokenized off this thread
        self._stop_requested = False
        self._last_keepalive = time.monotonic()
        self.step_started_at: float | None = None
        self.address = ""

    # ------------------------------------------------------------------ lifecycle

    def bind(self, listening_fd: int | None = None) -> str:
        """Bind the ROUTER (on `listening_fd`, a tcp socket already listening on the address, when given)."""
        self._router = bind_router(self._context, self._args, listening_fd)
        self.address = self._router.address
        return self.address

    @property
    def _socket(self) -> zmq.Socket | None:
        return self._router.socket if self._router is not None else None

    def request_shutdown(self) -> None:
        """Ask the loop to stop after the current step (safe to call from a signal handler)."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def serve_forever(self) -> None:
        assert self._socket is not None, "bind() first"
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        core = self._core
        try:
            while not self._stop_requested:
                if poller.poll(self._poll_timeout_ms()):
                    self._read_messages()
                if self._pending:
                    self._accept_tokenized()
                # has_ready_work() stays true while an abort awaits its report by step().
                if core.has_ready_work():
                    for req in self._step():
                        self._reply_for(req)
                self._keepalive()
        finally:
            self._shutdown()

    def _poll_timeout_ms(self) -> int:
        """0 when a step has work; a short wait while only compiles, disk loads or tokenizing are pending; else idle."""
        core = self._core
        if core.has_ready_work():
            return 0
        if self._pending:
            return PENDING_POLL_MS
        return GRAMMAR_POLL_MS if core.has_work() else IDLE_POLL_MS

    def _step(self) -> list[Req]:
        core = self._core
        self.step_started_at = time.monotonic()  # read by the watchdog (run_server)
        try:
            return core.step()
        except Exception as e:
            # The scheduler contains forward failures itself; this is a bug elsewhere in a step.
            logger.exception("scheduler step failed; aborting every request in flight")
            message = f"internal error in the runtime: {type(e).__name__}: {e}"
            for key, flight in self._inflight.items():
                flight.abort_message = message
                core.abort(key)
            core.check_invariant()  # AssertionError ends serve_forever: unsafe to go on
            return []
        finally:
            self.step_started_at = None

    def _shutdown(self) -> None:
        core = self._core
        for pending in self._pending.cancel_all():
            self._send(pending.identity, protocol.ErrorReply(pending.msg.rid, "server shutting down", "aborted"))
        for key, flight in list(self._inflight.items()):
            core.abort(key)
            if not flight.client_gone:
                self._send(flight.identity, protocol.ErrorReply(flight.rid, "server shutting down", "aborted"))
        if self._inflight:
            logger.info("aborted %d in-flight request(s) on shutdown", len(self._inflight))
            # Everything is aborted, so this step runs no forward: it only collects the abort
            # reports, leaving the scheduler idle for whoever owns the core next (tests, Engine).
            core.step()
        self._inflight.clear()
        if self._router is not None:
            self._router.close(SHUTDOWN_LINGER_MS)
            self._router = None
        if self._owned_context:
            self._context.term()

    # ------------------------------------------------------------------ incoming

    def _read_messages(self) -> None:
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                frames = self._receive()
            except zmq.Again:
                return
            self._handle_guarded(frames)

    def _receive(self) -> list[zmq.Frame]:
        """One message's frames (identity, message), not copied out of ZeroMQ's buffers. ZeroMQ's size limit
        is per frame and a message may hold any number of them: past the third they are dropped as they are
        read (the message is refused for its frame count), so no message makes this loop keep more than three."""
        assert self._socket is not None
        frame = self._socket.recv(zmq.NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:
            frame = self._socket.recv(copy=False)
            if len(frames) < 3:
                frames.append(frame)
        return frames

    def _handle_guarded(self, frames: list[zmq.Frame]) -> None:
        """No single message may end the loop: whatever handling it raises is logged and answered."""
        try:
            self._handle(frames)
        except Exception as e:
            logger.exception("internal error handling a message of %d bytes", sum(map(len, frames[1:])))
            try:
                self._send(frames[0].bytes, protocol.ErrorReply("", f"internal error: {type(e).__name__}", "internal"))
            except Exception:
                logger.exception("could not answer that message either")

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) != 2:  # (a peer here passed the handshake: with --api-key, it holds the key, zap.py)
            self._send(identity, protocol.ErrorReply("", "expected a message in one frame, got several"))
            return
        payload = frames[1].bytes
        envelope = read_envelope(payload)
        rid = echoable_rid(envelope)
        if len(payload) > self._args.max_message_bytes:
            limit = self._args.max_message_bytes
            self._send(identity, protocol.ErrorReply(rid, f"message of {len(payload)} bytes exceeds --max-message-bytes {limit}"))
            return
        try:
            msg = protocol.decode_request(payload)
        except DECODE_ERRORS as e:  # the sender's fault, never the server's (code bad_request)
            self._send(identity, protocol.ErrorReply(rid, describe_invalid(envelope, e)))
            return
        try:
            self._dispatch(identity, msg)
        except Exception as e:  # a bug must cost one request, not the server
            logger.exception("internal error handling %s", type(msg).__name__)
            self._send(identity, protocol.ErrorReply(msg.rid, f"internal error: {e}", "internal"))

    def _dispatch(self, identity: bytes, msg: protocol.Request) -> None:
        if isinstance(msg, protocol.GenerateReq):
            self._add_generate(identity, msg)
        elif isinstance(msg, protocol.AbortReq):
            key = self._key(identity, msg.rid)
            flight = self._inflight.get(key)
            pending = self._pending.cancel(key)
            if pending is not None:  # not tokenized yet: it ends with no output
                reason = FinishReason(FinishKind.ABORT, message=ABORTED_BY_CLIENT, error_code=None)
                meta_info = {"id": msg.rid, "prompt_tokens": len(pending.msg.input_ids or ()), "completion_tokens": 0,
                             "cached_tokens": 0, "finish_reason": reason.to_json()}
                for reply in final_replies(msg.rid, "", [], meta_info, ("", []) if pending.msg.stream else None):
                    self._send(identity, reply)
            elif flight is None:  # in flight but finished (its report due next step): its final answers it
                self._send(identity, protocol.ErrorReply(msg.rid, f"unknown request id {msg.rid!r} (never started or already finished)"))
            else:
                self._core.abort(key, by_client=True)
        elif isinstance(msg, protocol.FlushCacheReq):
            self._send(identity, protocol.InfoReply(msg.rid, {"flushed": bool(self._core.flush_cache())}))
        elif isinstance(msg, protocol.ServerInfoReq):
            self._send(identity, protocol.InfoReply(msg.rid, self._core.server_info()))
        elif isinstance(msg, protocol.HealthReq):
            self._send(identity, protocol.InfoReply(msg.rid, {"ok": True}))
        elif isinstance(msg, protocol.UnpinSessionReq):  # session ids are the runtime's (as SGLang's), not per client
            self._send(identity, protocol.InfoReply(msg.rid, {"unpinned": self._core.unpin_session(msg.session_id)}))

    def _add_generate(self, identity: bytes, msg: protocol.GenerateReq) -> None:
        key = self._key(identity, msg.rid)
        if key in self._inflight or key in self._pending:
            self._send(identity, protocol.ErrorReply(msg.rid, f"request id {msg.rid!r} is already in flight"))
            return
        try:
            req = self._core.prepare(key, msg.text, msg.input_ids, msg.sampling_params, return_logprob=msg.return_logprob,
                                     logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                                     priority=msg.priority, stream=msg.stream, session_pin=msg.session_pin)
        except ValueError as e:
            self._send(identity, protocol.ErrorReply(msg.rid, str(e)))
            return
        if isinstance(req, Req):
            self._submit(identity, msg, req)
        else:
            self._pending.add(key, identity, msg, req)

    def _accept_tokenized(self) -> None:
        for key, pending in self._pending.take_ready():
            try:
                req = pending.future.result()
            except ValueError as e:
                self._send(pending.identity, protocol.ErrorReply(pending.msg.rid, str(e)))
                continue
            except Exception as e:
                logger.exception("tokenizing %s failed", key)
                self._send(pending.identity, protocol.ErrorReply(pending.msg.rid, f"internal error: {e}", "internal"))
                continue
            try:
                self._submit(pending.identity, pending.msg, req)
            except Exception as e:  # as in _handle: a bug must cost one request, not the server
                logger.exception("internal error queueing %s", key)
                self._send(pending.identity, protocol.ErrorReply(pending.msg.rid, f"internal error: {e}", "internal"))

    def _submit(self, identity: bytes, msg: protocol.GenerateReq, req: Req) -> None:
        try:
            self._core.submit(req)
        except QueueFullError as e:
            self._send(identity, protocol.ErrorReply(msg.rid, str(e), "queue_full"))
            return
        except ValueError as e:
            self._send(identity, protocol.ErrorReply(msg.rid, str(e)))
            return
        stream_state = self._core.stream_state(req) if msg.stream else None
        self._inflight[req.rid] = InFlight(identity, msg.rid, stream_state)

    @staticmethod
    def _key(identity: bytes, rid: str) -> str:  # the scheduler's rid: the client's, prefixed by its identity
        return f"{identity.hex()}/{rid}"

    # ------------------------------------------------------------------ outgoing

    def _reply_for(self, req: Req) -> None:
        flight = self._inflight.get(req.rid)
        if flight is None:
            return
        try:
            replies = replies_for(req, flight, self._core, self._args.stream_interval)
            done = req.finished
        except Exception as e:  # a bug (e.g. in detokenizing) must cost this request, not the server
            logger.exception("could not build the reply for %s", req.rid)
            if not req.finished:
                self._core.abort(req.rid)  # its abort report finds no flight: silent
            replies = [protocol.ErrorReply(flight.rid, f"internal error: {type(e).__name__}: {e}", "internal")]
            done = True
        if done:
            del self._inflight[req.rid]
        if not flight.client_gone:
            for reply in replies:
                self._send(flight.identity, reply)

    def _keepalive(self) -> None:
        now = time.monotonic()
        if now - self._last_keepalive < KEEPALIVE_S:
            return
        self._last_keepalive = now
        for identity in {f.identity for f in self._inflight.values() if not f.client_gone}:
            self._send(identity, protocol.InfoReply("", {"keepalive": True}))

    def _send(self, identity: bytes, msg: protocol.Reply) -> bool:
        assert self._socket is not None
        try:
            self._socket.send_multipart([identity, self._encoder.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
        self._client_gone(identity)
        return False

    def _client_gone(self, identity: bytes) -> None:
        gone = [key for key, f in self._inflight.items() if f.identity == identity and not f.client_gone]
        for key in gone:
            flight = self._inflight[key]
            flight.client_gone = True
            flight.abort_message = "client disconnected"
            self._core.abort(key)
        if gone:
            logger.info("client %s went away or stopped reading; aborted %d request(s)", identity.hex(), len(gone))
