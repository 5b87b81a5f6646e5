"""The client's liveness tracking (ZMTP heartbeats + a socket monitor, client/transport.py): a runtime that
is busy for longer than the health timeout is waited for, a dead or stopped one fails the waiting
requests promptly with RuntimeUnavailableError.

Fake ROUTER peers (threads, or a subprocess when it must be stopped) cover the transport's cases in
milliseconds; real `sgl-lite serve` processes on a tiny model, whose forward passes are made slow by the
SGL_LITE_FAULT_INJECT=slow_forward:SECONDS test hook, cover the runtime end to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from waiting import wait_until

from sgl_lite.lang.launcher import Runtime, _child_env
from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import RuntimeClient, RuntimeUnavailableError
from sgl_lite.runtime.model_executor.fault_injection import ENV_VAR, parse_slow_forward_spec
from sgl_lite.runtime.server.zap import require_handshake
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(180)

# Tight liveness settings: a peer silent (at the application level) for longer than HEALTH_TIMEOUT_S
# must still count as alive as long as its process runs.
HEALTH = dict(health_interval=0.1, health_timeout=0.5)
STEP_S = 1.5  # each forward pass of the slow runtime: three times the health timeout
SERVER_ARGS = dict(dtype="float32", device="cpu", context_length=512, max_total_tokens=4096, log_level="warning")


class SilentRouter:
    """A ROUTER in a thread that reads one request, then does not touch its socket for `stall_s` seconds
    (no reply, no health answer), then answers it with Finished. With `close_after_request`, it closes
    its socket instead, as a dying runtime's OS would."""

    def __init__(self, address: str, stall_s: float = 0.0, close_after_request: bool = False) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.handshake = require_handshake(self.context, self.socket, None)  # as a runtime's (zap.py)
        self.socket.bind(address)
        self.address = address
        self.received: list[protocol.Request] = []
        self._stall_s = stall_s
        self._close_after_request = close_after_request
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        identity, data = self.socket.recv_multipart()
        msg = protocol.decode_request(data)
        self.received.append(msg)
        if self._close_after_request:
            self.socket.close(linger=0)
            return
        time.sleep(self._stall_s)
        self.socket.send_multipart([identity, protocol.encode(protocol.Finished(msg.rid, "done", [1], {}))])

    def close(self) -> None:
        self._thread.join(10)
        if not self.socket.closed:
            self.socket.close(linger=0)
        self.handshake.stop()
        self.context.term()


def test_a_peer_silent_longer_than_the_health_timeout_is_waited_for(tmp_path: Path) -> None:
    server = SilentRouter(f"ipc://{tmp_path}/busy.sock", stall_s=6 * HEALTH["health_timeout"])
    try:
        with RuntimeClient(server.address, timeout=60, **HEALTH) as client:
            started = time.monotonic()
            texts: list[str] = []
            waiter = threading.Thread(target=lambda: texts.append(client.generate("wait for me").text))
            waiter.start()
            time.sleep(3 * HEALTH["health_timeout"])
            # Inside the silence: connected (liveness, what HTTP /health reports), not answering (readiness).
            assert client.is_connected()
            assert not client.health(timeout=HEALTH["health_timeout"])
            waiter.join()
            assert texts == ["done"]
            assert time.monotonic() - started >= 6 * HEALTH["health_timeout"]  # the silence really happened
    finally:
        server.close()


def test_a_closed_connection_fails_waiters_at_once_and_aborts_their_requests(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/dying.sock"
    server = SilentRouter(address, close_after_request=True)
    # A generous health timeout: only the disconnect itself can end the wait before it.
    with RuntimeClient(address, timeout=60, health_interval=0.1, health_timeout=30) as client:
        started = time.monotonic()
        with pytest.raises(RuntimeUnavailableError, match="connection was lost") as info:
            client.generate("doomed", rid="doomed-1")
        assert time.monotonic() - started < 30
        assert address in str(info.value)
        server.close()
        # The abort was queued for the runtime: a peer that comes back on the address receives it.
        successor = zmq.Context()
        router = successor.socket(zmq.ROUTER)
        handshake = require_handshake(successor, router, None)
        router.bind(address)
        try:
            assert router.poll(10_000), "the queued abort never arrived"
            data = router.recv_multipart()[-1]
            msg = protocol.decode_request(data)
            assert isinstance(msg, protocol.AbortReq) and msg.rid == "doomed-1"
        finally:
            router.close(linger=0)
            handshake.stop()
            successor.term()


def test_nothing_listening_fails_after_the_health_timeout(tmp_path: Path) -> None:
    with RuntimeClient(f"ipc://{tmp_path}/nobody.sock", timeout=60, **HEALTH) as client:
        started = time.monotonic()
        with pytest.raises(RuntimeUnavailableError, match="no connection to it within 0.5 s"):
            client.generate("anyone?")
        assert time.monotonic() - started < 60


def test_health_settings_are_validated() -> None:
    for bad in (dict(health_interval=0), dict(health_timeout=-1.0), dict(timeout=float("nan"))):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            RuntimeClient("tcp://127.0.0.1:9", **bad)


# A ROUTER in its own process (so that it can be stopped): prints its address, then the type and rid
# of every request it reads, and never answers. Like the runtime's (server/event_loop.py) it hands a
# routing id over to the newest connection: on resuming, it may see the client's new connection before
# the old one's close, and without handover it would drop the new one, and the abort on it.
_MUTE_ROUTER = """
import sys, zmq
from sgl_lite.runtime import protocol
from sgl_lite.runtime.server.zap import require_handshake
context = zmq.Context()
sock = context.socket(zmq.ROUTER)
require_handshake(context, sock, None)
sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(f"tcp://127.0.0.1:{port}", flush=True)
while True:
    msg = protocol.decode_request(sock.recv_multipart()[-1])
    print(type(msg).__name__, msg.rid, flush=True)
"""


@pytest.fixture
def mute_router_process() -> Iterator[tuple[subprocess.Popen, str, list[str]]]:
    """(process, its address, the lines it has printed since, growing while the test runs)."""
    proc = subprocess.Popen([sys.executable, "-c", _MUTE_ROUTER], stdout=subprocess.PIPE, text=True, env=_child_env())
    address = proc.stdout.readline().strip()
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.strip())

    threading.Thread(target=read, daemon=True).start()
    try:
        yield proc, address, lines
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_a_stopped_process_counts_as_dead_and_gets_the_abort_when_it_resumes(mute_router_process) -> None:
    proc, address, lines = mute_router_process
    with RuntimeClient(address, timeout=60, health_interval=0.2, health_timeout=1.0) as client:
        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                client.generate("frozen", rid="frozen-1")
            except BaseException as e:  # noqa: BLE001 - checked below
                outcome.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_until(lambda: "GenerateReq frozen-1" in lines, "the request to reach the peer")
        os.kill(proc.pid, signal.SIGSTOP)
        waiter.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], RuntimeUnavailableError), outcome
        assert "no ZMTP heartbeat for 1 s" in str(outcome[0])
        assert "AbortReq frozen-1" not in lines
        os.kill(proc.pid, signal.SIGCONT)
        # The client reconnects to the resumed process and delivers the abort it queued.
        wait_until(lambda: "AbortReq frozen-1" in lines, "the abort to reach the resumed peer")


# ---------------------------------------------------------------------------- a real runtime, slow steps


def start_slow_runtime(tiny_model: str) -> Runtime:
    spec = f"slow_forward:{STEP_S}"
    assert parse_slow_forward_spec(spec) == STEP_S
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = spec  # the server process inherits it
    try:
        return Runtime(model_path=tiny_model, startup_timeout=180, client_timeout=60, **SERVER_ARGS)
    finally:
        if old is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = old


@pytest.fixture(scope="module")
def slow_runtime(tiny_model: str) -> Iterator[Runtime]:
    rt = start_slow_runtime(tiny_model)
    yield rt
    os.kill(rt.pid, signal.SIGCONT)  # in case a failed test left it stopped
    rt.shutdown()


def test_steps_longer_than_the_health_timeout_do_not_fail_waiting_clients(slow_runtime: Runtime) -> None:
    params = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    with RuntimeClient(slow_runtime.address, timeout=60, **HEALTH) as blocking, \
            RuntimeClient(slow_runtime.address, timeout=60, **HEALTH) as streaming:
        stream = streaming.generate_stream("The quick brown fox", sampling_params=params)
        done = blocking.generate("Berlin is the capital of", sampling_params=params)
        chunks = list(stream)
    assert len(done.output_ids) == 2
    # Two forward passes of STEP_S each: the client waited through silences longer than its health timeout.
    assert done.meta_info["e2e_latency"] >= 2 * STEP_S > HEALTH["health_timeout"]
    assert chunks and chunks[-1].meta_info["completion_tokens"] == 2
    assert_idle_without_leaks(slow_runtime.client, timeout=30)


def test_a_stopped_runtime_fails_its_waiters_and_frees_their_kv_when_resumed(slow_runtime: Runtime) -> None:
    observer = slow_runtime.client
    with RuntimeClient(slow_runtime.address, timeout=60, health_interval=0.2, health_timeout=1.0) as client:
        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                client.generate("The quick brown fox", sampling_params={"max_new_tokens": 200, "ignore_eos": True})
            except BaseException as e:  # noqa: BLE001 - checked below
                outcome.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_until(lambda: observer.server_info()["num_running"] == 1, "the request to run")
        os.kill(slow_runtime.pid, signal.SIGSTOP)
        try:
            waiter.join(30)
        finally:
            os.kill(slow_runtime.pid, signal.SIGCONT)
        assert len(outcome) == 1 and isinstance(outcome[0], RuntimeUnavailableError), outcome
        assert "connection was lost" in str(outcome[0])
    # Resumed, the runtime gets the abort (or finds the client gone) instead of generating 200 tokens.
    assert_idle_without_leaks(observer, timeout=30)


def test_a_killed_runtime_fails_every_waiting_client_well_before_the_health_timeout(tiny_model: str) -> None:
    health_timeout = 30.0  # the heartbeat timeout cannot be what ends these waits
    rt = start_slow_runtime(tiny_model)
    try:
        clients = [RuntimeClient(rt.address, timeout=60, health_interval=0.5, health_timeout=health_timeout)
                   for _ in range(3)]
        outcomes: dict[int, tuple[BaseException | None, float]] = {}

        def wait(i: int) -> None:
            try:
                if i % 2:
                    for _ in clients[i].generate_stream(f"prompt {i}", sampling_params={"max_new_tokens": 50}):
                        pass
                else:
                    clients[i].generate(f"prompt {i}", sampling_params={"max_new_tokens": 50})
                outcomes[i] = (None, time.monotonic())
            except BaseException as e:  # noqa: BLE001 - checked below
                outcomes[i] = (e, time.monotonic())

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        wait_until(lambda: rt.client.server_info()["num_running"] == len(clients), "every request to run")
        os.kill(rt.pid, signal.SIGKILL)  # most likely inside a STEP_S-long forward pass
        killed_at = time.monotonic()
        for t in threads:
            t.join(90)
        for c in clients:
            c.close()
    finally:
        rt.shutdown()
    assert sorted(outcomes) == list(range(len(clients)))
    for i, (error, when) in outcomes.items():
        assert isinstance(error, RuntimeUnavailableError) and "connection was lost" in str(error), (i, error)
        assert when - killed_at < health_timeout, f"client {i} failed only after {when - killed_at:.1f} s"


def test_http_health_says_busy_through_a_long_step(slow_runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """/health is the front's answer, whatever the step length: "busy" (200) while the runtime is alive inside
    a step, even when the front has never seen the runtime answer before (it used to say 503 then)."""
    import json
    import urllib.error
    import urllib.request

    from sgl_lite.http import app as http_app
    from sgl_lite.http.launch import HttpServerThread

    def health() -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"{http.url}/health", timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    # The readiness probe gives up well inside one STEP_S step.
    monkeypatch.setattr(http_app, "HEALTH_TIMEOUT_S", STEP_S / 5)
    client = RuntimeClient(slow_runtime.address, timeout=60, **HEALTH)
    http = HttpServerThread(http_app.create_app(client))
    try:
        busy = threading.Thread(target=lambda: client.generate("a long step", sampling_params={"max_new_tokens": 1}))
        busy.start()
        time.sleep(STEP_S / 3)
        assert not client.health(timeout=STEP_S / 5)  # inside a step: not ready...
        status, body = health()  # ...and the front's first /health comes now
        assert status == 200 and json.loads(body)["status"] == "busy"
        busy.join()
        assert health() == (200, b"")  # between steps: ready
    finally:
        http.stop()
        client.close()
