"""Hostile peers on the ZeroMQ wire (issue 16): deeply nested messages, huge rids, peers that never
read, and a burst of thousands of requests on one connection.

Each test runs the real RuntimeServer in a thread of this process over one tiny-model Engine core
(loopback / ipc only), and ends with the core's KV accounting checked.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.server.transport import RuntimeServer
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.testing.fuzz import NESTED_FIELDS, nested_message
from sgl_lite.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(180)

SERVER_ARGS = dict(dtype="float32", device="cpu", context_length=512, max_total_tokens=8192, log_level="warning")
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Engine]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    with Engine(model_path=str(model), **SERVER_ARGS) as eng:
        yield eng


class ServerThread:
    def __init__(self, engine: Engine, address: str, **overrides: object) -> None:
        args = ServerArgs(model_path=engine.args.model_path, host=address, port=0, **overrides)
        self.engine = engine
        self.server = RuntimeServer(engine.core, args)
        self.address = self.server.bind()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.request_shutdown()
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.engine.core.scheduler.check_invariant()


@pytest.fixture
def serve(engine, tmp_path) -> Iterator:
    started: list[ServerThread] = []

    def start(**overrides: object) -> ServerThread:
        address = overrides.pop("host", f"ipc://{tmp_path / uuid.uuid4().hex[:8]}.sock")
        started.append(ServerThread(engine, str(address), **overrides))
        return started[-1]

    yield start
    for s in started:
        s.stop()


class Peer:
    """A bare DEALER socket that sends raw messages (after a key frame) and reads replies only when asked to."""

    def __init__(self, address: str, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def ask(self, payload: bytes, timeout: float = 10.0) -> tuple[protocol.Reply | None, int]:
        """The first non-keepalive reply and its size in bytes."""
        self.send(payload)
        deadline = time.monotonic() + timeout
        while self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            data = self.socket.recv()
            reply = protocol.decode_reply(data)
            if not (isinstance(reply, protocol.InfoReply) and reply.rid == ""):
                return reply, len(data)
        return None, 0

    def send(self, payload: bytes) -> None:
        self.socket.send_multipart(protocol.request_frames(payload, self.api_key))

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def still_serving(address: str, api_key: str | None = None) -> None:
    with RuntimeClient(address, api_key=api_key, timeout=60) as client:
        out = client.generate("The quick brown fox", sampling_params=GREEDY)
        assert len(out.output_ids) == 4
        assert client.health(timeout=10)


# ---------------------------------------------------------------------------- item 1: nesting


@pytest.mark.parametrize("api_key", [None, "s3cret"])
@pytest.mark.parametrize("field", ["type", "rid", "sampling_params", "json_schema", "unknown"])
def test_deeply_nested_message_gets_an_error_and_the_server_keeps_serving(serve, api_key, field):
    server = serve(api_key=api_key)
    peer = Peer(server.address, api_key)
    try:
        payload = nested_message(field, depth=1000)
        assert len(payload) < 1200  # about 1 KB
        reply, _ = peer.ask(payload)
        assert isinstance(reply, protocol.ErrorReply), reply
        assert reply.code == "bad_request"
        assert reply.message
        assert server.thread.is_alive()
    finally:
        peer.close()
    still_serving(server.address, api_key)


def test_a_client_refuses_to_send_what_the_server_could_not_decode(serve):
    server = serve()
    schema: dict = {}
    for _ in range(5000):
        schema = {"a": schema}
    with RuntimeClient(server.address, timeout=30) as client:
        with pytest.raises(RuntimeRequestError, match="nested too deeply"):
            client.generate("hi", sampling_params={"max_new_tokens": 1, "json_schema": schema})
        with pytest.raises(RuntimeRequestError, match="64-bit"):
            client.generate("hi", sampling_params={"max_new_tokens": 1}, priority=2**70)
        with pytest.raises(RuntimeRequestError, match="surrogate"):
            client.generate("a\ud800b", sampling_params={"max_new_tokens": 1})
        assert client.health(timeout=10)


def test_nested_payloads_decode_to_a_decode_error():
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):  # a dict of anything
        protocol.decode_request(nested_message("json_schema", depth=5000, kind="map"))
    for kind in ("array", "map"):
        for field in NESTED_FIELDS:  # typed fields fail fast on the type; what is skipped or Any, on depth
            with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
                protocol.decode_request(nested_message(field, depth=5000, kind=kind))
            with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
                protocol.decode_reply(nested_message(field, depth=5000, kind=kind))


# ---------------------------------------------------------------------------- item 3: rid and send queue


def test_a_rid_over_the_limit_is_refused_and_not_echoed(serve):
    server = serve()
    peer = Peer(server.address)
    try:
        long_rid = "r" * (protocol.MAX_RID_CHARS + 1)
        payload = msgspec.msgpack.encode({"type": "HealthReq", "rid": long_rid})
        reply, size = peer.ask(payload)
        assert isinstance(reply, protocol.ErrorReply) and reply.rid == ""
        assert f"<= {protocol.MAX_RID_CHARS}" in reply.message and "rid" in reply.message
        assert size < 300
        ok = protocol.HealthReq("r" * protocol.MAX_RID_CHARS)
        reply, _ = peer.ask(protocol.encode(ok))
        assert isinstance(reply, protocol.InfoReply) and reply.rid == ok.rid
    finally:
        peer.close()
    with RuntimeClient(server.address, timeout=30) as client:
        with pytest.raises(RuntimeRequestError, match="longer than"):
            client.generate("x", sampling_params=GREEDY, rid="r" * (protocol.MAX_RID_CHARS + 1))


def test_unauthenticated_replies_echo_nothing(serve):
    server = serve(api_key="s3cret")
    peer = Peer(server.address, "wrong")
    try:
        huge_rid = "r" * 1_000_000
        reply, size = peer.ask(msgspec.msgpack.encode({"type": "HealthReq", "rid": huge_rid}))
        assert isinstance(reply, protocol.ErrorReply) and reply.code == "unauthorized" and reply.rid == ""
        assert size < 200
        # The key is checked before any byte of the message is read: what would be a bad request is refused
        # as unauthorized, and so is a key frame too long to be the key, or a message without one.
        reply, _ = peer.ask(nested_message("rid", depth=5000))
        assert isinstance(reply, protocol.ErrorReply) and reply.code == "unauthorized"
    finally:
        peer.close()
    for frames, says in (([b"s3cret" * 100_000, protocol.encode(protocol.HealthReq("long-key"))], "api_key"),
                         ([protocol.encode(protocol.HealthReq("no-key-frame"))], "got one frame"),
                         ([b"s3cret", protocol.encode(protocol.HealthReq("many"))] + [b"x"] * 1000, "more than two")):
        peer = Peer(server.address)
        try:
            peer.socket.send_multipart(frames)
            assert peer.socket.poll(10_000)
            reply = protocol.decode_reply(peer.socket.recv())
            assert isinstance(reply, protocol.ErrorReply) and reply.rid == "" and says in reply.message, reply
        finally:
            peer.close()
    # A RuntimeClient with a wrong key still learns, for each of its requests, that the key is wrong.
    with RuntimeClient(server.address, api_key="wrong", timeout=30) as bad:
        with pytest.raises(RuntimeRequestError) as info:
            bad.generate("The quick brown fox", sampling_params=GREEDY)
        assert info.value.code == "unauthorized"
        assert not bad.health(timeout=5)
    still_serving(server.address, "s3cret")


def test_an_unauthenticated_message_is_not_read(serve, monkeypatch):
    """A peer without the key costs the server a comparison of its key frame per message, whatever the
    message holds: not a byte of it is decoded (before, the envelope was, to find the key inside it)."""
    from sgl_lite.runtime.server import transport

    decoded: list[int] = []
    real = transport.read_envelope
    monkeypatch.setattr(transport, "read_envelope", lambda payload: decoded.append(len(payload)) or real(payload))
    server = serve(api_key="s3cret")
    big = msgspec.msgpack.encode({"type": "GenerateReq", "rid": "big", "input_ids": list(range(200_000))})
    for key in ("wrong", None):
        peer = Peer(server.address, key)
        try:
            reply, _ = peer.ask(big)
            assert isinstance(reply, protocol.ErrorReply) and reply.code == "unauthorized"
        finally:
            peer.close()
    assert decoded == []
    still_serving(server.address, "s3cret")
    assert decoded  # the authenticated client's messages are


def test_a_peer_that_does_not_read_is_dropped(serve, engine):
    server = serve(max_queued_replies_per_client=64)
    peer = Peer(server.address)
    try:
        long = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        peer.send(protocol.encode(protocol.GenerateReq("stream", text="The quick brown fox", stream=True,
                                                              sampling_params=protocol.SamplingParams(**long))))
        flood = 3000
        for i in range(flood):  # ServerInfo replies are a few KB each; the peer reads none of them
            peer.send(protocol.encode(protocol.ServerInfoReq(f"info-{i}")))
        # The server gives up on the peer: its stream is aborted long before 400 tokens.
        with RuntimeClient(server.address, timeout=30) as other:
            deadline = time.monotonic() + 60
            while other.server_info()["num_running"] + other.server_info()["num_waiting"]:
                assert time.monotonic() < deadline, "the non-reading peer's request is still running"
                time.sleep(0.1)
        received: list[protocol.Reply] = []
        while peer.socket.poll(1000):
            received.append(protocol.decode_reply(peer.socket.recv()))
        infos = [r for r in received if isinstance(r, protocol.InfoReply) and r.rid.startswith("info-")]
        assert len(infos) < flood  # replies past its queue were never kept for it
        assert not any(isinstance(r, protocol.Finished) for r in received)
    finally:
        peer.close()
    still_serving(server.address)


# ---------------------------------------------------------------------------- item 4: a burst on one connection


def test_a_burst_on_one_connection_does_not_make_the_client_declare_the_runtime_dead(serve, engine, monkeypatch):
    scheduler = engine.core.scheduler
    real_step = scheduler.step

    def slow_step():  # a busy runtime: every step takes a while, so the burst is read over several seconds
        time.sleep(0.25)
        return real_step()

    monkeypatch.setattr(scheduler, "step", slow_step)
    server = serve(host="127.0.0.1")
    count = 3000
    with RuntimeClient(server.address, timeout=120, health_interval=0.2, health_timeout=1.0) as client:
        async def run_all():
            import asyncio

            return await asyncio.gather(*(client.async_generate(input_ids=[1 + i % 300], sampling_params={"max_new_tokens": 0})
                                          for i in range(count)), return_exceptions=True)

        import asyncio

        results = asyncio.run(run_all())
        failures = [r for r in results if isinstance(r, BaseException)]
        assert not failures, f"{len(failures)} failed, first: {failures[0]!r}"
    monkeypatch.setattr(scheduler, "step", real_step)
    still_serving(server.address)
