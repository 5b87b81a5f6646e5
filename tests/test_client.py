"""RuntimeClient against a small fake ROUTER server (the real runtime is exercised in test_server.py)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Callable

import pytest
import zmq
from waiting import wait_until

from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError, RuntimeUnavailableError
from sgl_lite.runtime.server.zap import require_handshake

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[protocol.Request], list[protocol.Reply]]


class FakeRouter:
    """Answers each request with handler(msg), and health checks with ok. Replies to different requests
    are sent in shuffled order to exercise the client's routing. (Liveness: test_client_liveness.py.)"""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.received: list[protocol.Request] = []
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._handshake = require_handshake(self._context, self._socket, None)  # as a runtime's (zap.py)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(20):
                continue
            batch = []
            while self._socket.poll(0):
                identity, data = self._socket.recv_multipart()
                msg = protocol.decode_request(data)
                self.received.append(msg)
                if isinstance(msg, protocol.HealthReq):
                    batch.append((identity, [protocol.InfoReply(msg.rid, {"ok": True})]))
                else:
                    batch.append((identity, self.handler(msg)))
            random.shuffle(batch)
            for identity, replies in batch:
                for reply in replies:
                    self._socket.send_multipart([identity, protocol.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._handshake.stop()
        self._context.term()


def echo_handler(msg: protocol.Request) -> list[protocol.Reply]:
    """Generates the prompt reversed, streamed one character per chunk when asked."""
    if isinstance(msg, protocol.GenerateReq):
        if msg.text == "fail":
            return [protocol.ErrorReply(msg.rid, "temperature must be >= 0", "bad_request")]
        answer = msg.text[::-1]
        chunks = [protocol.TokenChunk(msg.rid, ch, [i]) for i, ch in enumerate(answer)] if msg.stream else []
        return [*chunks, protocol.Finished(msg.rid, answer, list(range(len(answer))), {"rid_seen": msg.rid})]
    if isinstance(msg, protocol.ServerInfoReq):
        return [protocol.InfoReply(msg.rid, {"model_path": "fake"})]
    if isinstance(msg, protocol.FlushCacheReq):
        return [protocol.InfoReply(msg.rid, {"flushed": True})]
    if isinstance(msg, protocol.AbortReq):
        return [protocol.ErrorReply(msg.rid, f"unknown request id {msg.rid!r}")]
    return []


def silent_handler(msg: protocol.Request) -> list[protocol.Reply]:
    return []


@pytest.fixture
def echo_server():
    server = FakeRouter(echo_handler)
    yield server
    server.close()


def test_generate_and_info_calls(echo_server):
    with RuntimeClient(echo_server.address, timeout=10) as client:
        out = client.generate("hello", sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out.text == "olleh"
        assert client.server_info() == {"model_path": "fake"}
        assert client.flush_cache() is True
        assert client.health()
    sent = [m for m in echo_server.received if isinstance(m, protocol.GenerateReq)]
    assert sent[0].sampling_params.max_new_tokens == 4


def test_concurrent_threads_get_their_own_answers(echo_server):
    results: dict[int, str] = {}
    with RuntimeClient(echo_server.address, timeout=10) as client:
        def work(i: int) -> None:
            for j in range(10):
                results[i * 100 + j] = client.generate(f"prompt {i} {j}").text

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == {i * 100 + j: f"prompt {i} {j}"[::-1] for i in range(8) for j in range(10)}


def test_stream_chunks_add_up(echo_server):
    with RuntimeClient(echo_server.address, timeout=10) as client:
        chunks = list(client.generate_stream("streaming"))
    assert "".join(c.text for c in chunks) == "gnimaerts"


def test_error_reply_raises_with_code(echo_server):
    with RuntimeClient(echo_server.address, timeout=10) as client:
        with pytest.raises(RuntimeRequestError, match="temperature") as info:
            client.generate("fail")
        assert info.value.code == "bad_request"
        with pytest.raises(RuntimeRequestError, match="nope"):
            client.abort("nope")
        with pytest.raises(RuntimeRequestError, match="tempurature"):
            client.generate("x", sampling_params={"tempurature": 1})


def test_async_variants(echo_server):
    async def main(client: RuntimeClient) -> tuple[list[str], str]:
        answers = await asyncio.gather(*(client.async_generate(f"a{i}") for i in range(5)))
        streamed = "".join([c.text async for c in client.async_generate_stream("async")])
        return [a.text for a in answers], streamed

    with RuntimeClient(echo_server.address, timeout=10) as client:
        answers, streamed = asyncio.run(main(client))
    assert answers == [f"a{i}"[::-1] for i in range(5)]
    assert streamed == "cnysa"


def test_request_timeout_when_server_lives_but_never_answers():
    server = FakeRouter(silent_handler)
    try:
        with RuntimeClient(server.address, timeout=0.5, health_interval=0.1) as client:
            with pytest.raises(RuntimeUnavailableError, match="not responding"):
                client.generate("ignored")
            time.sleep(0.2)
        # Giving up on a request aborts it on the runtime.
        gen = [m.rid for m in server.received if isinstance(m, protocol.GenerateReq)]
        aborted = [m.rid for m in server.received if isinstance(m, protocol.AbortReq)]
        assert gen and aborted == gen
    finally:
        server.close()


def test_close_aborts_in_flight_requests():
    server = FakeRouter(silent_handler)
    try:
        client = RuntimeClient(server.address, timeout=30)
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                client.generate("pending", rid="rid-1")
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                errors.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        wait_until(lambda: any(isinstance(m, protocol.GenerateReq) for m in server.received), "the request to reach the server", 5, poll_s=0.01)
        client.close()
        t.join(5)
        assert isinstance(errors[0], RuntimeRequestError) and errors[0].code == "closed"
        wait_until(lambda: any(isinstance(m, protocol.AbortReq) for m in server.received), "the abort to reach the server", 5, poll_s=0.01)
        assert [m.rid for m in server.received if isinstance(m, protocol.AbortReq)] == ["rid-1"]
    finally:
        server.close()


def test_closing_a_stream_early_aborts_it():
    def slow_stream(msg: protocol.Request) -> list[protocol.Reply]:
        if isinstance(msg, protocol.GenerateReq):
            return [protocol.TokenChunk(msg.rid, "first", [1])]
        return []

    server = FakeRouter(slow_stream)
    try:
        with RuntimeClient(server.address, timeout=10) as client:
            stream = client.generate_stream("x", rid="s1")
            assert next(stream).text == "first"
            stream.close()
            wait_until(lambda: any(isinstance(m, protocol.AbortReq) for m in server.received), "the abort to reach the server", 5, poll_s=0.01)
        assert [m.rid for m in server.received if isinstance(m, protocol.AbortReq)] == ["s1"]
    finally:
        server.close()


def test_generate_all_sends_every_request_before_waiting_and_keeps_their_order():
    """A server that answers only once it holds all three requests: a client waiting for each reply before
    sending the next request would time out. The fake router shuffles its replies."""
    held: list[protocol.GenerateReq] = []

    def barrier(msg: protocol.Request) -> list[protocol.Reply]:
        if not isinstance(msg, protocol.GenerateReq):
            return []
        held.append(msg)
        if len(held) < 3:
            return []
        return [protocol.Finished(m.rid, m.text[::-1], [], {}) for m in held]

    server = FakeRouter(barrier)
    try:
        with RuntimeClient(server.address, timeout=5) as client:
            replies = client.generate_all([{"text": t} for t in ("one", "two", "three")])
        assert [r.text for r in replies] == ["eno", "owt", "eerht"]
    finally:
        server.close()


def test_generate_all_raises_the_first_failure_at_once_and_aborts_the_rest():
    def one_fails(msg: protocol.Request) -> list[protocol.Reply]:
        if isinstance(msg, protocol.GenerateReq) and msg.text == "fail":
            return [protocol.ErrorReply(msg.rid, "temperature must be >= 0", "bad_request")]
        return []  # the others never finish

    server = FakeRouter(one_fails)
    try:
        with RuntimeClient(server.address, timeout=30) as client:
            start = time.monotonic()
            with pytest.raises(RuntimeRequestError, match="temperature"):
                client.generate_all([{"text": "hang", "rid": "h1"}, {"text": "fail"}, {"text": "hang", "rid": "h2"}])
            assert time.monotonic() - start < 10  # not after the first request's timeout
            wait_until(lambda: len([m for m in server.received if isinstance(m, protocol.AbortReq)]) >= 2, "both aborts to reach the server", 5, poll_s=0.01)
        assert sorted(m.rid for m in server.received if isinstance(m, protocol.AbortReq)) == ["h1", "h2"]
    finally:
        server.close()


def test_a_server_that_cannot_read_our_framing_fails_every_request_at_once():
    """A server of another wire version answers each message with rid "" (it cannot tell the request): the
    client fails what it has pending instead of waiting out its timeout."""
    def old_server(msg: protocol.Request) -> list[protocol.Reply]:
        return [protocol.ErrorReply("", "expected one message frame, got 2", "bad_request")]

    server = FakeRouter(old_server)
    try:
        with RuntimeClient(server.address, timeout=60) as client:
            start = time.monotonic()
            with pytest.raises(RuntimeRequestError, match="frame"):
                client.generate("hello")
            assert time.monotonic() - start < 10
    finally:
        server.close()


def test_a_request_is_aborted_once_however_often_it_is_asked():
    """/abort_request with abort_all, posted again while an abort is on its way, must neither send a second
    abort nor count the request again: it stays pending until the runtime's answer."""
    server = FakeRouter(silent_handler)
    try:
        with RuntimeClient(server.address, timeout=30) as client:
            client._submit("r1", protocol.GenerateReq("r1", text="x"), lambda item: None, is_generate=True)
            assert client.in_flight() == ["r1"]
            assert client.abort_in_flight("r1") is True
            assert client.abort_in_flight("r1") is False
            assert client.abort_in_flight("never-sent") is False
            wait_until(lambda: any(isinstance(m, protocol.AbortReq) for m in server.received), "the abort to reach the server", 5, poll_s=0.01)
            time.sleep(0.2)
            assert [m.rid for m in server.received if isinstance(m, protocol.AbortReq)] == ["r1"]
    finally:
        server.close()
