"""What a RuntimeClient holds is released when the requests it was for end (client/transport.py): requests
failed for want of a runtime are not kept queued for a runtime that comes later, streams dropped unread
are aborted, and a client closed or dropped without close() ends its I/O thread and closes its sockets.

Each test uses a bare ROUTER socket on an ipc path as the runtime, bound, closed and bound again at will.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import zmq
from waiting import wait_until

from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError, RuntimeUnavailableError
from sgl_lite.runtime.server.zap import require_handshake

pytestmark = pytest.mark.timeout(60)

HEALTH = dict(health_interval=0.1, health_timeout=0.5)
IO_THREAD = "sgl-lite-client-io"


def io_threads() -> int:
    return sum(t.name == IO_THREAD for t in threading.enumerate())


class Router:
    """A runtime stand-in that reads requests and answers nothing."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.handshake = require_handshake(self.context, self.socket, None)  # as a runtime's (zap.py)
        self.socket.bind(address)

    def read(self, wait_s: float = 1.0) -> list[tuple[str, str]]:
        """(message type, rid) of everything that arrives until the socket is quiet for `wait_s`."""
        seen: list[tuple[str, str]] = []
        while self.socket.poll(int(wait_s * 1000)):
            msg = protocol.decode_request(self.socket.recv_multipart()[-1])
            seen.append((type(msg).__name__, msg.rid))
        return seen

    def close(self) -> None:
        self.socket.close(linger=0)
        self.handshake.stop()
        self.context.term()


def test_requests_failed_while_no_runtime_listens_are_not_delivered_to_a_later_one(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/later.sock"
    with RuntimeClient(address, timeout=30, **HEALTH) as client:
        for i in range(5):
            with pytest.raises(RuntimeUnavailableError, match="no connection"):
                client.generate("nobody is there", rid=f"stale-{i}")
        router = Router(address)
        try:
            # The runtime that comes up gets nothing of them: their callers were told they failed.
            assert router.read() == []
            # And the client works with it.
            threading.Thread(target=lambda: client.health(timeout=5), daemon=True).start()
            assert [kind for kind, _ in router.read()] == ["HealthReq"]
        finally:
            router.close()


def test_a_lost_runtime_gets_the_owed_aborts_and_nothing_failed_since(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/lost.sock"
    router = Router(address)
    with RuntimeClient(address, timeout=30, health_interval=0.1, health_timeout=1.0) as client:
        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                client.generate("in flight", rid="in-flight")
            except BaseException as e:  # noqa: BLE001 - checked below
                outcome.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert router.read(wait_s=5) == [("GenerateReq", "in-flight")]
        router.close()  # the runtime is gone with the request
        waiter.join(10)
        assert len(outcome) == 1 and "connection was lost" in str(outcome[0])
        # While it is away, a new request fails for want of a connection ...
        with pytest.raises(RuntimeUnavailableError, match="no connection"):
            client.generate("too late", rid="too-late")
        # ... and the runtime that comes back gets only the abort of what it was running.
        successor = Router(address)
        try:
            assert successor.read() == [("AbortReq", "in-flight")]
        finally:
            successor.close()


def test_a_stream_dropped_before_its_first_chunk_is_aborted(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/stream.sock"
    router = Router(address)
    try:
        with RuntimeClient(address, timeout=30, **HEALTH) as client:
            stream = client.generate_stream("never read", rid="unread")
            assert router.read(wait_s=5) == [("GenerateReq", "unread")]
            del stream
            gc.collect()
            assert not client._transport.is_pending("unread")
            assert router.read() == [("AbortReq", "unread")]
    finally:
        router.close()


def test_a_client_dropped_without_close_ends_its_thread_and_sockets(tmp_path: Path) -> None:
    before = io_threads()
    client = RuntimeClient(f"ipc://{tmp_path}/dropped.sock", **HEALTH)
    transport = client._transport
    assert io_threads() == before + 1
    del client
    gc.collect()
    wait_until(lambda: io_threads() == before, "the dropped client's I/O thread to end", 10)
    assert transport.closed and transport._context.closed


def test_a_closed_client_fails_each_waiter_once_and_releases_everything(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/closed.sock"
    router = Router(address)
    try:
        before = io_threads()
        client = RuntimeClient(address, timeout=30, **HEALTH)
        outcomes: dict[int, list[BaseException]] = {i: [] for i in range(4)}

        def wait(i: int) -> None:
            try:
                if i % 2:
                    for _ in client.generate_stream("waiting", rid=f"w{i}"):
                        pass
                else:
                    client.generate("waiting", rid=f"w{i}")
            except BaseException as e:  # noqa: BLE001 - checked below
                outcomes[i].append(e)

        waiters = [threading.Thread(target=wait, args=(i,)) for i in outcomes]
        for t in waiters:
            t.start()
        assert sorted(rid for _, rid in router.read(wait_s=5)) == [f"w{i}" for i in outcomes]
        client.close()
        for t in waiters:
            t.join(10)
        for errors in outcomes.values():
            assert len(errors) == 1 and isinstance(errors[0], RuntimeRequestError) and errors[0].code == "closed"
        assert sorted(rid for kind, rid in router.read() if kind == "AbortReq") == [f"w{i}" for i in outcomes]
        assert io_threads() == before and client._transport._context.closed
        with pytest.raises(RuntimeRequestError, match="closed"):
            client.generate("after close")
    finally:
        router.close()
