"""Starting the HTTP front: blocking (`run_http_server`, the `sgl-lite http` command), in a thread
of this process (`HttpServerThread`, for tests and notebooks), or as a child process beside a
runtime server (`spawn_http_server`, for `sgl-lite serve --http-port`).

The API key travels to a child process in the environment (SGL_LITE_API_KEY), not on its command
line, where any local user could read it with `ps`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import click

from sgl_lite.runtime.server_args import API_KEY_ENV

logger = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 8000
_PARENT_POLL_S = 1.0


def run_http_server(runtime_address: str, host: str = "127.0.0.1", port: int = DEFAULT_HTTP_PORT,
                    api_key: str | None = None, served_model_name: str | None = None, *,
                    runtime_api_key: str | None = None, log_level: str = "info") -> None:
    """Serve the HTTP API for the runtime at `runtime_address` until interrupted.

    `api_key` guards the HTTP routes; the runtime is called with `runtime_api_key` (default: the
    same key, as when `sgl-lite serve --api-key K --http-port P` starts both).
    """
    import uvicorn

    from sgl_lite.http.app import create_app
    from sgl_lite.runtime.client import RuntimeClient

    client = RuntimeClient(runtime_address, api_key=runtime_api_key or api_key)
    try:
        app = create_app(client, api_key=api_key, served_model_name=served_model_name)
        logger.info("HTTP API for runtime %s on http://%s:%d%s", runtime_address, host, port,
                    " (API key required)" if api_key else "")
        # uvicorn's access log: one line per HTTP request (client, method, path, status), as SGLang prints.
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=True)
    finally:
        client.close()


class HttpServerThread:
    """A uvicorn server for `app` in a daemon thread; port 0 picks a free port (see `.port`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 30.0) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off")
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
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)


def spawn_http_server(runtime_address: str, host: str = "127.0.0.1", port: int = DEFAULT_HTTP_PORT,
                      api_key: str | None = None, served_model_name: str | None = None,
                      log_level: str = "info") -> subprocess.Popen[bytes]:
    """Start `sgl-lite http` as a child process that exits when this process does."""
    cmd = [sys.executable, "-m", "sgl_lite.http.launch", "--runtime", runtime_address, "--host", host,
           "--port", str(port), "--log-level", log_level, "--parent-pid", str(os.getpid())]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    # The parent's stdout carries the runtime's ready line for the launcher; the child logs to stderr.
    return subprocess.Popen(cmd, env=env, stdout=sys.stderr)


def runtime_address_of(host: str, port: int) -> str:
    """The address to reach a runtime started with --host/--port (for `serve --http-port`)."""
    if host.startswith("ipc://"):
        return host
    if port == 0:
        raise ValueError("--http-port needs a fixed runtime --port (0 picks a port the HTTP server cannot know)")
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else host  # a wildcard bind is reached via loopback
    return f"tcp://{connect_host}:{port}"


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        logger.info("parent process %d is gone; HTTP server exiting", parent_pid)
        os._exit(0)

    threading.Thread(target=watch, name="sgl-lite-http-parent-watch", daemon=True).start()


@click.command("http")
@click.option("--runtime", "runtime_address", required=True,
              help="Address of a running runtime server, e.g. tcp://127.0.0.1:30000.")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP bind address (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_HTTP_PORT, show_default=True, help="HTTP port.")
@click.option("--api-key", envvar=API_KEY_ENV, default=None,
              help=f"Require 'Authorization: Bearer <key>' on every route but /health (env {API_KEY_ENV}); "
                   "also sent to the runtime unless --runtime-api-key is given.")
@click.option("--runtime-api-key", default=None, help="Key of the runtime server, when it differs from --api-key.")
@click.option("--served-model-name", default=None, help="Model name reported by /v1/models (default: the runtime's).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@click.option("--parent-pid", type=int, default=None, hidden=True)
def http_command(runtime_address: str, host: str, port: int, api_key: str | None, runtime_api_key: str | None,
                 served_model_name: str | None, log_level: str, parent_pid: int | None) -> None:
    """Serve the OpenAI-compatible and SGLang-native HTTP API in front of a running runtime."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    run_http_server(runtime_address, host, port, api_key, served_model_name,
                    runtime_api_key=runtime_api_key, log_level=log_level)


if __name__ == "__main__":
    http_command()
