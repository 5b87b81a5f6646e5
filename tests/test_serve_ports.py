"""SGLang's port layout: `serve --port P` is HTTP, the ZeroMQ endpoint of DSL programs is found from it;
and nothing hangs or half-starts on a wrong address or a taken port (issue 19, items 1 and 2).

One `sgl.Runtime` (tiny random model, loopback) is shared by the module; the start-up failures run
`sgl-lite serve` as a process of its own, each bounded by a hard timeout. Loopback only.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

import sgl_lite as sgl
from sgl_lite.lang.launcher import Runtime, _child_env
from sgl_lite.runtime.client import RuntimeClient, RuntimeUnavailableError
from sgl_lite.runtime.client.discovery import reachable_address
from sgl_lite.runtime.free_port import free_port
from sgl_lite.runtime.protocol import READY_PREFIX
from sgl_lite.runtime.server.ports import claim_ports
from sgl_lite.runtime.server_args import ServerArgs

SERVER_ARGS = dict(dtype="float32", max_total_tokens=2048, log_level="warning")


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir: Path):
    rt = Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, client_timeout=60, **SERVER_ARGS)
    yield rt
    rt.shutdown()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


# ---------------------------------------------------------------------------- 19.1 the layout


def test_http_on_the_url_names_the_zmq_endpoint(runtime):
    assert runtime.url.startswith("http://127.0.0.1:") and runtime.address.startswith("tcp://127.0.0.1:")
    info = _get(runtime.url + "/server_info")
    assert info["zmq_address"] == runtime.address
    assert runtime.url.endswith(f":{info['port']}") and runtime.address.endswith(f":{info['zmq_port']}")
    models = _get(runtime.url + "/v1/models")  # the OpenAI API is on the same port
    assert models["data"][0]["object"] == "model"


def test_runtime_endpoint_over_http_url_runs_a_dsl_program(runtime):
    @sgl.function
    def two_turns(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6)
        s += "\nQ: and then?\nA:" + sgl.gen("more", max_tokens=4)

    endpoint = sgl.RuntimeEndpoint(runtime.url)
    try:
        assert endpoint.address == runtime.address  # discovered over HTTP, used over ZeroMQ
        state = two_turns.run(question="Why?", backend=endpoint, temperature=0)
        expected = two_turns.run(question="Why?", backend=runtime, temperature=0)
        assert state["answer"] == expected["answer"] and state["more"] == expected["more"]
        assert state.get_meta_info("more")["cached_tokens"] > 0  # the second turn hit the first's cache
    finally:
        endpoint.close()


def test_generate_command_takes_the_url(runtime):
    result = subprocess.run([sys.executable, "-m", "sgl_lite.cli", "generate", "--address", runtime.url,
                             "--prompt", "Hello", "--max-new-tokens", "3"], capture_output=True, text=True,
                            timeout=120, env=_child_env())
    assert result.returncode == 0, result.stderr
    expected = json.loads(runtime.generate("Hello", {"max_new_tokens": 3, "temperature": 0}))["text"]
    assert result.stdout.rstrip("\n") == expected


def test_runtime_has_sglangs_methods(runtime):
    params = {"max_new_tokens": 5, "temperature": 0}
    out = json.loads(runtime.generate("The capital of France is", params))  # a JSON string, as SGLang's
    assert set(out) >= {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == 5
    batch = json.loads(runtime.generate(["a", "b"], params))
    assert isinstance(batch, list) and len(batch) == 2

    async def stream() -> str:
        return "".join([piece async for piece in runtime.async_generate("The capital of France is", params)])

    assert asyncio.run(stream()) == out["text"]
    info = asyncio.run(runtime.get_server_info())
    assert info["zmq_address"] == runtime.address
    tokenizer = runtime.get_tokenizer()
    assert tokenizer.decode(out["output_ids"]) == out["text"]


def test_reachable_address_takes_the_urls_host_for_a_local_bind():
    assert reachable_address("tcp://127.0.0.1:30001", "http://gpu-box:30000") == "tcp://gpu-box:30001"
    assert reachable_address("tcp://0.0.0.0:30001", "http://10.0.0.5:30000/") == "tcp://10.0.0.5:30001"
    assert reachable_address("tcp://10.0.0.7:30001", "http://gpu-box:30000") == "tcp://10.0.0.7:30001"
    assert reachable_address("ipc:///tmp/rt.sock", "http://gpu-box:30000") == "ipc:///tmp/rt.sock"


# ---------------------------------------------------------------------------- 19.2 nothing hangs


@pytest.mark.timeout(20)
@pytest.mark.parametrize("address, says", [
    ("127.0.0.1:30000", "no scheme"),
    ("http://127.0.0.1:30000", "HTTP URL"),
    ("tcp://127.0.0.1", "tcp://host:port"),
    ("udp://127.0.0.1:5", "tcp:// or ipc://"),
])
def test_zmq_client_refuses_a_wrong_address_at_once(address, says):
    started = time.monotonic()
    with pytest.raises(ValueError, match=says):
        RuntimeClient(address, timeout=600)
    assert time.monotonic() - started < 1.0


@pytest.mark.timeout(30)
def test_runtime_endpoint_on_an_http_server_that_is_not_sgl_lite():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Other(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = b'{"version": "0.4"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RuntimeUnavailableError, match="names no ZeroMQ endpoint"):
            sgl.RuntimeEndpoint(f"http://127.0.0.1:{server.server_address[1]}", timeout=5)
        with pytest.raises(RuntimeUnavailableError, match="no HTTP server answers"):
            sgl.RuntimeEndpoint(f"http://127.0.0.1:{free_port()}", timeout=5)  # nobody listens there
    finally:
        server.shutdown()


def _serve(model: Path, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sgl_lite.cli", "serve", "--model-path", str(model),
                           "--log-level", "warning", *flags], capture_output=True, text=True, timeout=timeout,
                          env=_child_env())


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert READY_PREFIX not in result.stdout  # nothing half-started announced itself
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.mark.timeout(120)
def test_http_port_taken_fails_the_whole_start_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The model path does not exist: the port check must come first and alone.
        line = _one_line_error(_serve(tmp_path / "no-model", "--port", str(port)))
    assert f"127.0.0.1:{port}" in line and "--port" in line and "no-model" not in line


@pytest.mark.timeout(120)
def test_no_listener_can_take_the_claimed_ports_while_the_model_loads():
    """serve claims both ports before the load and hands them over listening. A ZeroMQ port merely bound
    (not listening) let another SO_REUSEADDR listener (ZeroMQ binds so) take it during the load."""
    claimed = claim_ports(ServerArgs(model_path="unused", port=0))
    try:
        for port in (claimed.args.port, claimed.args.zmq_port):
            thief = socket.socket()
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                with pytest.raises(OSError):
                    thief.bind(("127.0.0.1", port))
                    thief.listen()
            finally:
                thief.close()
    finally:
        claimed.close()


def test_zmq_port_clash_is_found_before_the_model_loads(tmp_path):
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    zmq_port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        line = _one_line_error(_serve(tmp_path / "no-model", "--port", "0", "--zmq-port", str(zmq_port)))
        assert f"127.0.0.1:{zmq_port}" in line and "--zmq-port" in line and "no-model" not in line
    finally:
        router.close(linger=0)
        context.term()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.timeout(180)
def test_serve_on_an_ipv6_host(tiny_llama_dir):
    """`--host ::1`: both endpoints on IPv6, announced with the address in brackets (libzmq needs its IPv6
    option for the ROUTER and the DEALER; a bare ::1 in a URL is no URL)."""
    with Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, client_timeout=60, host="::1",
                 **SERVER_ARGS) as rt:
        assert rt.url.startswith("http://[::1]:") and rt.address.startswith("tcp://[::1]:")
        assert _get(rt.url + "/server_info")["zmq_address"] == rt.address
        out = rt.client.generate("The quick brown fox", sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert len(out.output_ids) == 3


@pytest.mark.timeout(120)
def test_an_ipc_path_a_server_answers_on_is_refused_before_the_model_loads(tmp_path):
    path = tmp_path / "live.sock"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"ipc://{path}")
    try:
        line = _one_line_error(_serve(tmp_path / "no-model", "--port", "0", "--host", f"ipc://{path}"))
        assert str(path) in line and "--host" in line and "no-model" not in line
    finally:
        router.close(linger=0)
        context.term()
    # A file nobody answers on any more (a killed server's) is no obstacle: the next check is the model's.
    line = _one_line_error(_serve(tmp_path / "no-model", "--port", "0", "--host", f"ipc://{path}"))
    assert "no-model" in line


@pytest.mark.timeout(180)
def test_the_server_stops_when_its_http_front_dies(tiny_llama_dir):
    process = subprocess.Popen([sys.executable, "-m", "sgl_lite.cli", "serve", "--model-path", str(tiny_llama_dir),
                                "--port", "0", "--dtype", "float32", "--log-level", "warning"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env())
    try:
        line = process.stdout.readline()
        assert line.startswith(READY_PREFIX), process.stderr.read() if process.poll() is not None else line
        front_pid = int(subprocess.run(["pgrep", "-P", str(process.pid), "-f", "sgl_lite.http.launch"],
                                       capture_output=True, text=True).stdout.split()[0])
        os.kill(front_pid, signal.SIGKILL)
        assert process.wait(30) == 0  # stopped as on SIGTERM, not left serving ZeroMQ without HTTP
        assert "HTTP front exited" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.timeout(180)
def test_a_terminal_ctrl_c_stops_the_server_quietly(tiny_llama_dir):
    """Ctrl-C in a terminal signals the whole foreground process group. The front and the tensor-parallel
    ranks are serve's to stop: when they took the SIGINT themselves, a rank died mid-collective with a
    traceback and serve logged that its front had died (an error) while it was stopping anyway. Ranks log
    at serve's --log-level."""
    process = subprocess.Popen([sys.executable, "-m", "sgl_lite.cli", "serve", "--model-path", str(tiny_llama_dir),
                                "--port", "0", "--dtype", "float32", "--log-level", "warning", "--tp-size", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env(),
                               start_new_session=True)  # its own process group, as a shell job
    try:
        line = process.stdout.readline()
        assert line.startswith(READY_PREFIX), process.stderr.read() if process.poll() is not None else line
        front_pid = int(subprocess.run(["pgrep", "-P", str(process.pid), "-f", "sgl_lite.http.launch"],
                                       capture_output=True, text=True).stdout.split()[0])
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(60) == 0
        stderr = process.stderr.read()
        assert "exited" not in stderr and "Traceback" not in stderr and "INFO" not in stderr, stderr
        with pytest.raises(ProcessLookupError):  # the front was stopped with it
            os.kill(front_pid, 0)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.timeout(180)
def test_a_sigterm_while_the_front_starts_stops_without_announcing_readiness(tiny_llama_dir):
    """The ready line is a promise to launchers that the server serves: one printed after a SIGTERM
    already asked it to stop was followed by the server's exit."""
    process = subprocess.Popen([sys.executable, "-m", "sgl_lite.cli", "serve", "--model-path", str(tiny_llama_dir),
                                "--port", "0", "--dtype", "float32", "--log-level", "info"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env())
    try:
        for line in process.stderr:  # the model is loaded; the socket binds and the front starts next
            if "runtime ready" in line:
                break
        time.sleep(0.3)  # past the bind (milliseconds), inside the front's start (a Python process's, >= 1 s)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert READY_PREFIX not in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
