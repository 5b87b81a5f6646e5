"""Thread-safe, torch-free client of a runtime server (ZeroMQ DEALER, msgspec messages).

The transport (transport.py) owns the socket in a background thread and routes each reply by
rid to the sink of the request that asked: a `queue.Queue` for the blocking calls, an asyncio queue
(fed with `loop.call_soon_threadsafe`) for the async ones. Every wait is bounded by `timeout`, and
the transport's liveness tracking (ZMTP heartbeats and a socket monitor, independent of the runtime's
scheduler steps) fails pending requests early when the runtime dies: nothing ever hangs on a dead
runtime (RuntimeUnavailableError). Error replies raise RuntimeRequestError.
"""

from __future__ import annotations

import asyncio
import queue
import time
import uuid
import weakref
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

import msgspec

from sgl_lite.runtime import protocol
from sgl_lite.runtime.client.errors import RuntimeRequestError, RuntimeUnavailableError
from sgl_lite.runtime.client.transport import ClientTransport, Item, Sink
from sgl_lite.runtime.protocol import ErrorReply, Finished, InfoReply, SamplingParams, TokenChunk

__all__ = ["RuntimeClient", "RuntimeRequestError", "RuntimeUnavailableError"]

_ABORT_ANSWER_WAIT_S = 5.0


class RuntimeClient:
    """`timeout` bounds every wait for a reply. Liveness is ZeroMQ's (transport.py): a ZMTP
    heartbeat every `health_interval` s, answered by the runtime's libzmq I/O thread even while its
    scheduler is inside a long step. Pending requests fail with RuntimeUnavailableError at once when the
    runtime process exits, within `health_interval + health_timeout` s when it stops answering heartbeats
    (stopped, frozen, unreachable host), and after `health_timeout` s without any connection to it."""

    def __init__(self, address: str, api_key: str | None = None, timeout: float = 600.0, *,
                 health_interval: float = 1.0, health_timeout: float = 10.0) -> None:
        for name, value in (("timeout", timeout), ("health_interval", health_interval), ("health_timeout", health_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds; got {value!r}")
        self.address = address
        self.api_key = api_key
        self.timeout = timeout
        self._transport = ClientTransport(address, api_key, health_interval, health_timeout)
        # A client dropped without close() would leave its I/O thread, sockets and context running for
        # the life of the process (the thread holds the transport, not the client).
        weakref.finalize(self, self._transport.close).atexit = False

    # ------------------------------------------------------------------ public API

    def generate(self, text: str | None = None, input_ids: list[int] | None = None,
                 sampling_params: dict[str, Any] | SamplingParams | None = None, **options: Any) -> Finished:
        """Blocking generate; options: return_logprob, logprob_start_len, top_logprobs_num, priority, rid, session_pin."""
        rid, request = self._generate_req(text, input_ids, sampling_params, stream=False, **options)
        replies: queue.Queue[Item] = queue.Queue()
        self._submit(rid, request, replies.put, is_generate=True)
        return self._expect(self._wait(replies, rid), Finished)

    def generate_all(self, calls: Sequence[Mapping[str, Any]]) -> list[Finished]:
        """Blocking generate of several requests at once, from this thread: every request is sent before
        any reply is awaited (so the runtime can batch them), and the whole wait is bounded by `timeout`.
        Each mapping holds generate()'s arguments; the replies come back in the calls' order. The first
        failure to arrive is raised at once, and the requests still running are aborted."""
        replies: queue.Queue[tuple[int, Item]] = queue.Queue()
        rids: list[str] = []
        try:
            for call in calls:
                rid, request = self._generate_req(stream=False, **call)
                self._submit(rid, request, lambda item, i=len(rids): replies.put((i, item)), is_generate=True)
                rids.append(rid)
            results: list[Finished] = [None] * len(rids)  # type: ignore[list-item]  # each set below
            deadline = time.monotonic() + self.timeout
            for _ in rids:
                try:
                    i, item = replies.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise RuntimeUnavailableError(f"runtime at {self.address} is not responding: {len(rids)} requests "
                                                  f"not all answered within {self.timeout:g} s") from None
                results[i] = self._expect(item, Finished)
            return results
        finally:
            for rid in rids:
                self._transport.abandon(rid)  # a no-op for a request already answered

    def generate_stream(self, text: str | None = None, input_ids: list[int] | None = None,
                        sampling_params: dict[str, Any] | SamplingParams | None = None,
                        **options: Any) -> Iterator[TokenChunk]:
        """Sends the request now; the iterator yields TokenChunks, the last one with the full meta_info.
        Closing the iterator early, or dropping it (even before its first chunk), aborts the request."""
        rid, request = self._generate_req(text, input_ids, sampling_params, stream=True, **options)
        replies: queue.Queue[Item] = queue.Queue()
        self._submit(rid, request, replies.put, is_generate=True)
        stream = self._iterate_stream(rid, replies)
        # A generator never started runs no `finally`: its request would run to the end for nobody.
        weakref.finalize(stream, self._transport.abandon, rid).atexit = False
        return stream

    async def async_generate(self, text: str | None = None, input_ids: list[int] | None = None,
                             sampling_params: dict[str, Any] | SamplingParams | None = None,
                             **options: Any) -> Finished:
        rid, request = self._generate_req(text, input_ids, sampling_params, stream=False, **options)
        replies: asyncio.Queue[Item] = asyncio.Queue()
        self._submit(rid, request, self._async_sink(replies), is_generate=True)
        return self._expect(await self._async_wait(replies, rid), Finished)

    async def async_generate_stream(self, text: str | None = None, input_ids: list[int] | None = None,
                                    sampling_params: dict[str, Any] | SamplingParams | None = None,
                                    **options: Any) -> AsyncIterator[TokenChunk]:
        """The request is sent when iteration starts; leaving the loop early aborts it."""
        rid, request = self._generate_req(text, input_ids, sampling_params, stream=True, **options)
        replies: asyncio.Queue[Item] = asyncio.Queue()
        self._submit(rid, request, self._async_sink(replies), is_generate=True)
        try:
            while True:
                reply = self._expect(await self._async_wait(replies, rid), (TokenChunk, Finished))
                if isinstance(reply, Finished):
                    return
                yield reply
        finally:
            self._transport.abandon(rid)  # a no-op once a final reply arrived; aborts a stream left early

    def abort(self, rid: str) -> None:
        """Abort one of this client's requests; RuntimeRequestError when the runtime does not know it."""
        if self._transport.is_pending(rid):
            self.abort_in_flight(rid)
            return
        replies: queue.Queue[Item] = queue.Queue()
        # Only an unknown rid gets an answer (an ErrorReply naming it); silence means it was aborted.
        self._submit(rid, protocol.AbortReq(rid), replies.put, is_generate=False)
        try:
            reply = replies.get(timeout=min(self.timeout, _ABORT_ANSWER_WAIT_S))
        except queue.Empty:
            self._transport.abandon(rid)
            return
        self._expect(reply, InfoReply)

    def abort_in_flight(self, rid: str) -> bool:
        """Abort `rid` if it is one of this client's requests still waiting for its final reply and not
        already being aborted; False (and nothing sent) otherwise. Never waits: its waiter receives its
        output so far, ending as a finished one does, with finish_reason {"type": "abort"} (SGLang's
        answer to /abort_request); a request that finished meanwhile is unknown to the runtime, whose
        answer nobody waits for."""
        if not self._transport.claim_abort(rid):
            return False
        self._transport.send(protocol.AbortReq(rid))
        return True

    def in_flight(self) -> list[str]:
        """The rids of this client's generate requests that have no final reply yet."""
        return self._transport.pending_generates()

    def flush_cache(self) -> bool:
        return bool(self._call(protocol.FlushCacheReq(self._new_rid())).get("flushed"))

    def server_info(self) -> dict[str, Any]:
        return self._call(protocol.ServerInfoReq(self._new_rid()))

    def unpin_session(self, session_id: str) -> None:
        """The session that requests named in `session_pin` ended: the runtime evicts its prefix like any other
        from now on. Sent at once and never waited for; the runtime handles this client's later requests after
        it (one connection, in order)."""
        if not 1 <= len(session_id) <= protocol.MAX_RID_CHARS:
            raise RuntimeRequestError(f"session_id must have 1 to {protocol.MAX_RID_CHARS} characters; got {len(session_id)}")
        rid = self._new_rid()
        self._submit(rid, protocol.UnpinSessionReq(rid, session_id), lambda reply: None, is_generate=False)

    def is_connected(self) -> bool:
        """True while the connection to the runtime is established and answering ZMTP heartbeats:
        the process is alive, even inside a long scheduler step (liveness, not readiness)."""
        return self._transport.link_up

    def health(self, timeout: float = 5.0) -> bool:
        """True when the runtime answers a HealthReq within `timeout` s. The runtime answers between
        scheduler steps, so this tells "ready to serve soon"; a False during one long step does not mean
        dead (waiting requests use the heartbeat-based liveness instead)."""
        try:
            self._call(protocol.HealthReq(self._new_rid()), timeout=timeout)
            return True
        except (RuntimeUnavailableError, RuntimeRequestError):
            return False

    def close(self) -> None:
        """Abort this client's in-flight generate requests, then stop its I/O thread."""
        self._transport.close()

    def __enter__(self) -> RuntimeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ request plumbing

    def _generate_req(self, text: str | None = None, input_ids: list[int] | None = None,
                      sampling_params: dict[str, Any] | SamplingParams | None = None, *, stream: bool,
                      rid: str | None = None, **options: Any) -> tuple[str, protocol.GenerateReq]:
        if isinstance(sampling_params, SamplingParams):
            params = sampling_params
        else:
            try:
                params = msgspec.convert(sampling_params or {}, SamplingParams)
            except msgspec.ValidationError as e:
                raise RuntimeRequestError(f"invalid sampling_params: {e}") from None
        rid = rid or self._new_rid()
        return rid, protocol.GenerateReq(rid, text=text, input_ids=input_ids, sampling_params=params,
                                         stream=stream, **options)

    @staticmethod
    def _new_rid() -> str:
        return uuid.uuid4().hex

    def _submit(self, rid: str, msg: protocol.Request, sink: Sink, *, is_generate: bool) -> None:
        self._transport.submit(rid, msg, sink, is_generate=is_generate)

    def _call(self, msg: protocol.Request, timeout: float | None = None) -> dict[str, Any]:
        replies: queue.Queue[Item] = queue.Queue()
        self._submit(msg.rid, msg, replies.put, is_generate=False)
        return self._expect(self._wait(replies, msg.rid, timeout), InfoReply).info

    def _wait(self, replies: queue.Queue[Item], rid: str, timeout: float | None = None) -> Item:
        wait_s = self.timeout if timeout is None else timeout
        try:
            return replies.get(timeout=wait_s)
        except queue.Empty:
            self._transport.abandon(rid)
            return RuntimeUnavailableError(f"runtime at {self.address} is not responding: no answer to request {rid} within {wait_s:g} s")

    async def _async_wait(self, replies: asyncio.Queue[Item], rid: str) -> Item:
        try:
            return await asyncio.wait_for(replies.get(), self.timeout)
        except asyncio.TimeoutError:
            self._transport.abandon(rid)
            return RuntimeUnavailableError(f"runtime at {self.address} is not responding: no answer to request {rid} within {self.timeout:g} s")
        except asyncio.CancelledError:
            self._transport.abandon(rid)
            raise

    @staticmethod
    def _async_sink(replies: asyncio.Queue[Item]) -> Sink:
        loop = asyncio.get_running_loop()

        def sink(item: Item) -> None:
            try:
                loop.call_soon_threadsafe(replies.put_nowait, item)
            except RuntimeError:
                pass  # the event loop is closed: nobody is waiting any more

        return sink

    @staticmethod
    def _expect(item: Item, kinds: type | tuple[type, ...]) -> Any:
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, ErrorReply):
            raise RuntimeRequestError(item.message, item.code)
        if not isinstance(item, kinds):
            raise RuntimeRequestError(f"unexpected reply {type(item).__name__} for request {item.rid}", "internal")
        return item

    def _iterate_stream(self, rid: str, replies: queue.Queue[Item]) -> Iterator[TokenChunk]:
        try:
            while True:
                reply = self._expect(self._wait(replies, rid), (TokenChunk, Finished))
                if isinstance(reply, Finished):
                    return
                yield reply
        finally:
            self._transport.abandon(rid)  # a no-op once a final reply arrived; aborts a stream left early
