"""Starting the HTTP front: blocking (`run_http_server`, the `sgl-lite http` command), in a thread
of this process (`HttpServerThread`, for tests and notebooks), or as a child process beside a
runtime server (`HttpFront`, for `sgl-lite serve`, on the socket that serve bound on --host/--port).

The API keys travel to a child process in the environment (SGL_LITE_API_KEY, SGL_LITE_ADMIN_API_KEY),
not on its command line, where any local user could read them with `ps`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import click

from sgl_lite.http.guards.access_log import LOGGED_BODY_CHARS
from sgl_lite.http.guards.limits import HEADER_READ_TIMEOUT_S, HttpLimits, guarded_h11_protocol
from sgl_lite.runtime.client.discovery import check_zmq_address
from sgl_lite.runtime.free_port import connect_host, url_host
from sgl_lite.runtime.server.parent_watch import exit_with_parent, stop_child
from sgl_lite.runtime.server_args import ADMIN_API_KEY_ENV, API_KEY_ENV, warn_if_exposed

logger = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 8000
# What the HTTP front prints on stdout once it serves on the socket `sgl-lite serve` gave it.
HTTP_READY_PREFIX = "SGL_LITE_HTTP_READY"
HTTP_STARTUP_TIMEOUT_S = 120.0


def run_http_server(runtime_address: str, host: str = "127.0.0.1", port: int = DEFAULT_HTTP_PORT,
                    api_key: str | None = None, served_model_name: str | None = None, *,
                    runtime_api_key: str | None = None, log_level: str = "info", fd: int | None = None,
                    limits: HttpLimits = HttpLimits(), admin_api_key: str | None = None,
                    log_requests: bool = False) -> None:
    """Serve the HTTP API for the runtime at `runtime_address` until interrupted.

    `api_key` guards the HTTP routes (`admin_api_key` the administrative ones); the runtime is called
    with `runtime_api_key` (default: the same key, as when `sgl-lite serve --api-key K` starts both). With `fd`, serve on that listening
    socket (inherited from `sgl-lite serve`, which bound --host/--port) and print HTTP_READY_PREFIX
    on stdout once serving.
    """
    import uvicorn

    from sgl_lite.http.app import create_app
    from sgl_lite.runtime.client import RuntimeClient

    client = RuntimeClient(runtime_address, api_key=runtime_api_key or api_key)
    try:
        app = create_app(client, api_key=api_key, served_model_name=served_model_name, limits=limits,
                         admin_api_key=admin_api_key, log_requests=log_requests)
        logger.info("HTTP API for runtime %s on http://%s:%d%s", runtime_address, host, port,
                    " (API key required)" if api_key else "")
        warn_if_exposed(host, api_key, "the HTTP API")
        # The app writes the access line of every request itself (guards/access_log.py), to the log on
        # stderr; uvicorn's own would go to stdout, which `serve` reads only for the ready line.
        config = uvicorn.Config(app, host=host, port=port, fd=fd, log_level=log_level, access_log=False,
                                http=guarded_h11_protocol())
        server = uvicorn.Server(config)
        if fd is not None:
            threading.Thread(target=_announce_when_started, args=(server,), daemon=True).start()
        server.run()
    finally:
        client.close()


def _announce_when_started(server: Any) -> None:
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    print(HTTP_READY_PREFIX, flush=True)


class HttpServerThread:
    """A uvicorn server for `app` in a daemon thread; port 0 picks a free port (see `.port`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 30.0,
                 header_timeout_s: float = HEADER_READ_TIMEOUT_S) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                                http=guarded_h11_protocol(header_timeout_s))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="sgl-lite-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {host}:{port} did not start")
            time.sleep(0.02)
        self.host = host
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)


class HttpFront:
    """The HTTP front of `sgl-lite serve`: a child process serving on a socket this process bound
    (sgl_lite.runtime.server.ports), so a taken port fails the start before anything loads."""

    def __init__(self, runtime_address: str, listening: socket.socket, api_key: str | None = None,
                 served_model_name: str | None = None, log_level: str = "info",
                 limits: HttpLimits = HttpLimits(), admin_api_key: str | None = None,
                 log_requests: bool = False) -> None:
        host, port = listening.getsockname()[:2]
        self.url = f"http://{url_host(connect_host(host))}:{port}"
        fd = listening.fileno()
        cmd = [sys.executable, "-m", "sgl_lite.http.launch", "--runtime", runtime_address, "--host", host,
               "--port", str(port), "--fd", str(fd), "--log-level", log_level, "--parent-pid", str(os.getpid())]
        if served_model_name:
            cmd += ["--served-model-name", served_model_name]
        if log_requests:
            cmd.append("--log-requests")
        for name, value in dataclasses.asdict(limits).items():
            cmd += ["--" + name.replace("_", "-"), str(value)]
        env = dict(os.environ)
        for name, key in ((API_KEY_ENV, api_key), (ADMIN_API_KEY_ENV, admin_api_key)):
            env.pop(name, None)
            if key:
                env[name] = key
        # The child's stdout carries its ready line (anything else on it is passed on to our stderr); its
        # logs, the access lines among them, go to stderr (ours). Its own session: a
        # terminal's Ctrl-C (sent to the whole foreground process group) reaches serve alone, which stops the
        # front after the runtime (stop); a front that took it too exited first and was logged as having died.
        self.process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, pass_fds=(fd,),
                                        start_new_session=True)
        self._ready = threading.Event()
        self._stopping = False
        threading.Thread(target=self._read_stdout, name="sgl-lite-http-front-stdout", daemon=True).start()

    def wait_ready(self, on_exit: Callable[[], None], timeout: float = HTTP_STARTUP_TIMEOUT_S) -> str:
        """Block until the front serves; afterwards `on_exit` runs if it ever exits on its own.
        RuntimeError (one line) when it exits or stays silent first."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.process.poll() is not None:
                raise RuntimeError(f"the HTTP front exited with code {self.process.returncode} before serving "
                                   "(its log is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP front did not start within {timeout:g} s")

        def watch() -> None:
            code = self.process.wait()
            if not self._stopping:
                logger.error("the HTTP front exited with code %s; stopping the server", code)
                on_exit()

        threading.Thread(target=watch, name="sgl-lite-http-front-watch", daemon=True).start()
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        stop_child(self.process, timeout)

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.strip() == HTTP_READY_PREFIX:
                self._ready.set()
            else:
                sys.stderr.write(line)


@click.command("http")
@click.option("--runtime", "runtime_address", required=True,
              help="Address of a running runtime server, e.g. tcp://127.0.0.1:30000.")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP bind address (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_HTTP_PORT, show_default=True, help="HTTP port.")
@click.option("--api-key", envvar=API_KEY_ENV, default=None,
              help=f"Require 'Authorization: Bearer <key>' on every route but /health (env {API_KEY_ENV}); "
                   "also sent to the runtime unless --runtime-api-key is given.")
@click.option("--runtime-api-key", default=None, help="Key of the runtime server, when it differs from --api-key.")
@click.option("--admin-api-key", envvar=ADMIN_API_KEY_ENV, default=None,
              help=f"The key of administrative requests (env {ADMIN_API_KEY_ENV}): /abort_request with abort_all, or "
                   "for a request another caller started.")
@click.option("--served-model-name", default=None, help="Model name reported by /v1/models (default: the runtime's).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@click.option("--log-requests", is_flag=True, default=False,
              help=f"The access line of each request also holds its body (the first {LOGGED_BODY_CHARS} characters).")
@click.option("--max-request-body-bytes", type=click.IntRange(min=1), default=HttpLimits.max_request_body_bytes,
              show_default=True, help="HTTP request bodies larger than this get 413.")
@click.option("--max-chat-messages", type=click.IntRange(min=1), default=HttpLimits.max_chat_messages,
              show_default=True, help="A chat request with more messages than this gets 400.")
@click.option("--max-request-fanout", type=click.IntRange(min=1), default=HttpLimits.max_request_fanout,
              show_default=True, help="At most this many generations (prompts x n) per request; more get 400.")
@click.option("--parent-pid", type=int, default=None, hidden=True)
@click.option("--fd", type=int, default=None, hidden=True)
def http_command(runtime_address: str, host: str, port: int, api_key: str | None, runtime_api_key: str | None,
                 admin_api_key: str | None, served_model_name: str | None, log_level: str, max_request_body_bytes: int,
                 max_chat_messages: int, max_request_fanout: int, parent_pid: int | None, fd: int | None,
                 log_requests: bool) -> None:
    """Serve the OpenAI-compatible and SGLang-native HTTP API in front of a running runtime."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if parent_pid is not None:
        exit_with_parent(parent_pid, lambda: os._exit(0))
    try:
        check_zmq_address(runtime_address)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--runtime") from None
    limits = HttpLimits(max_request_body_bytes, max_chat_messages, max_request_fanout)
    run_http_server(runtime_address, host, port, api_key, served_model_name,
                    runtime_api_key=runtime_api_key, log_level=log_level, fd=fd, limits=limits,
                    admin_api_key=admin_api_key, log_requests=log_requests)


if __name__ == "__main__":
    http_command()
