"""Start a runtime server in a child process and wait until it serves (`sgl.Runtime(...)`).

The child is `python -m sgl_lite.cli serve ... --port 0` (HTTP and ZeroMQ on free loopback ports);
it prints `SGL_LITE_READY <zmq address> <http url>` on stdout once it accepts requests, and exits
within seconds when this process dies (it watches our pid), however this process ends. Its stderr (the logs) is kept in a bounded buffer so a start-up
failure can be reported with its last lines, and is drained continuously so the child never blocks
on a full pipe.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, AsyncIterator

from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.runtime.client.discovery import http_json
from sgl_lite.runtime.protocol import READY_PREFIX
from sgl_lite.runtime.server.parent_watch import stop_child
from sgl_lite.runtime.server_args import ADMIN_API_KEY_ENV, API_KEY_ENV, ServerArgs, flag_of

STDERR_TAIL_LINES = 40
DEFAULT_STARTUP_TIMEOUT = 600.0
_live_runtimes: weakref.WeakSet[Runtime] = weakref.WeakSet()


SessionParams = dict[str, Any]
SESSION_PARAMS_KEYS = ("id", "rid", "offset", "replace", "drop_previous_output")  # SGLang's SessionParams


def checked_session_params(params: Any) -> Any:
    """`params` when it is a session_params dict (or a list of them) with only SGLang's keys and an id; else a
    ValueError naming what is wrong (the server checks the values)."""
    for entry in params if isinstance(params, list) else [params]:
        if not isinstance(entry, dict):
            raise ValueError(f"session_params must be a dict (or a list of dicts, one per prompt); got {entry!r}")
        unknown = sorted(set(entry) - set(SESSION_PARAMS_KEYS))
        if unknown:
            raise ValueError(f"session_params has unknown key(s) {unknown}; the keys are {', '.join(SESSION_PARAMS_KEYS)}")
        if "id" not in entry:
            raise ValueError("session_params needs an id: the session's, from open_session")
    return params


class RuntimeLaunchError(RuntimeError):
    """The server process exited or did not become ready in time."""


def server_flags(args: ServerArgs) -> list[str]:
    """Command-line flags reproducing `args` (only the values that differ from the defaults)."""
    flags: list[str] = []
    defaults = ServerArgs()
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        if value == getattr(defaults, f.name):
            continue
        if isinstance(value, bool):
            flags.append(flag_of(f.name, negated=not value))
        elif value is not None:
            flags += [flag_of(f.name), str(value)]
    return flags


def serve_command(args: ServerArgs) -> list[str]:
    """The `sgl-lite serve` command line for `args`, without the API keys: a child gets them
    through its environment (`api_key_env`), since any local user can read a command line (`ps`)."""
    return [sys.executable, "-m", "sgl_lite.cli", "serve", *server_flags(args.replace(api_key=None, admin_api_key=None))]


def api_key_env(env: dict[str, str], api_key: str | None, admin_api_key: str | None = None) -> dict[str, str]:
    """`env` for a child `serve` (or `http`) that must use exactly `api_key` (and `admin_api_key`): set,
    or removed when None so that a key in our own environment does not leak into a child started without one."""
    env = dict(env)
    for name, key in ((API_KEY_ENV, api_key), (ADMIN_API_KEY_ENV, admin_api_key)):
        env.pop(name, None)
        if key:
            env[name] = key
    return env


class Runtime:
    """A runtime server process: its HTTP API at `.url` and its ZeroMQ endpoint at `.address`, both on
    free loopback ports (or `host="ipc://..."` for the ZeroMQ side). DSL programs use `.endpoint`.

    `launch_timeout` is SGLang's name for `startup_timeout` (give one of them): seconds to wait for
    the server to be ready.
    """

    def __init__(self, model_path: str = "smollm2-135m", *, startup_timeout: float | None = None,
                 launch_timeout: float | None = None, client_timeout: float = 600.0, **server_args: Any) -> None:
        if startup_timeout is not None and launch_timeout is not None:
            raise ValueError("give startup_timeout or its SGLang alias launch_timeout, not both")
        timeout = next((t for t in (startup_timeout, launch_timeout) if t is not None), DEFAULT_STARTUP_TIMEOUT)
        if timeout <= 0:
            raise ValueError(f"launch_timeout/startup_timeout must be > 0 seconds; got {timeout:g}")
        server_args.setdefault("port", 0)
        self.args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        self.api_key = self.args.api_key
        self._client_timeout = client_timeout
        self._client: RuntimeClient | None = None
        self._endpoint: Any = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._ready = threading.Event()
        self.address = ""  # the ZeroMQ endpoint
        self.url = ""  # the HTTP API, SGLang's Runtime.url
        command = serve_command(self.args) + ["--parent-pid", str(os.getpid())]
        self._started = time.monotonic()
        _say(f"sgl.Runtime: starting `sgl-lite serve` for model {model_path} (its start-up log follows)")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=api_key_env(_child_env(), self.api_key, self.args.admin_api_key),
                                        start_new_session=True)
        _live_runtimes.add(self)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        try:
            self._wait_ready(timeout)
        except BaseException:  # Ctrl-C too: the server is in its own session, and nobody else could stop it
            self.shutdown()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def client(self) -> RuntimeClient:
        if self._client is None:
            self._client = RuntimeClient(self.address, api_key=self.api_key, timeout=self._client_timeout)
        return self._client

    @property
    def endpoint(self) -> Any:
        if self._endpoint is None:
            from sgl_lite.lang.backend.runtime_endpoint import RuntimeEndpoint

            self._endpoint = RuntimeEndpoint(self.address, api_key=self.api_key, timeout=self._client_timeout)
        return self._endpoint

    # ------------------------------------------------------------------ SGLang's Runtime API

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict[str, Any] | None = None,
                 return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] | None = None,
                 top_logprobs_num: int | list[int] | None = None, *, input_ids: list[int] | list[list[int]] | None = None,
                 rid: str | list[str] | None = None, session_params: SessionParams | list[SessionParams] | None = None) -> str:
        """POST /generate; returns the response as a JSON string, as SGLang's Runtime.generate does. As SGLang's
        Engine.generate: `input_ids` instead of a prompt, the request's `rid`, and `session_params` (a dict of
        id, rid, offset, replace, drop_previous_output; one per prompt of a batch, or one for all) to continue
        a request of a session that open_session opened; its response's meta_info["id"] is the rid to continue."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give a prompt or input_ids (one of them)")
        body: dict[str, Any] = {"text": prompt} if input_ids is None else {"input_ids": input_ids}
        body.update(sampling_params=sampling_params or {}, return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num)
        if rid is not None:
            body["rid"] = rid
        if session_params is not None:
            body["session_params"] = checked_session_params(session_params)
        return json.dumps(http_json(self.url + "/generate", self.api_key, body=body, timeout=self._client_timeout))

    def open_session(self, capacity_of_str_len: int, session_id: str | None = None, streaming: bool = False,
                     timeout: float | None = None) -> str:
        """POST /open_session (SGLang's Engine.open_session): a session holding at most `capacity_of_str_len` tokens,
        closed after `timeout` idle seconds (default: the server's); returns its id. While it is open the runtime
        keeps its latest request's KV in the prefix cache after every other prefix."""
        body = {"capacity_of_str_len": capacity_of_str_len, "session_id": session_id, "streaming": streaming,
                "timeout": timeout}
        return str(http_json(self.url + "/open_session", self.api_key, body=body, timeout=self._client_timeout))

    def close_session(self, session_id: str) -> None:
        """POST /close_session (SGLang's Engine.close_session): later requests naming it are refused (404), and
        its KV is evicted like any other."""
        http_json(self.url + "/close_session", self.api_key, body={"session_id": session_id}, timeout=self._client_timeout)

    async def async_generate(self, prompt: str, sampling_params: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """Stream the new text piece by piece (SGLang's Runtime.async_generate); over ZeroMQ here."""
        async for chunk in self.client.async_generate_stream(prompt, sampling_params=sampling_params):
            if chunk.text:
                yield chunk.text

    add_request = async_generate  # SGLang's alias

    async def get_server_info(self) -> dict[str, Any]:
        """GET /get_server_info (a coroutine, as in SGLang)."""
        return await asyncio.to_thread(http_json, self.url + "/get_server_info", self.api_key,
                                       timeout=self._client_timeout)

    def get_tokenizer(self) -> Any:
        """The server's Hugging Face tokenizer (loaded from the folder the server resolved the model to)."""
        from transformers import AutoTokenizer

        info = self.client.server_info()
        server_args = info.get("server_args") or {}
        return AutoTokenizer.from_pretrained(server_args.get("tokenizer_path") or info["model_path"])

    def shutdown(self, timeout: float = 10.0) -> None:
        """SIGTERM (the server aborts in-flight requests and closes), then SIGKILL if it lingers."""
        for owned in (self._endpoint, self._client):
            close = getattr(owned, "close", None)
            if close is not None:
                close()
        self._endpoint = self._client = None
        stop_child(self.process, timeout)
        _live_runtimes.discard(self)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr_tail)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.process.poll() is not None:
                # The stderr reader may still hold the last lines; give it a moment to finish.
                time.sleep(0.2)
                raise RuntimeLaunchError(
                    f"runtime server exited with code {self.process.returncode} before it was ready; "
                    f"last log lines:\n{self.stderr_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeLaunchError(f"runtime server not ready after {timeout:g} s (launch_timeout/startup_timeout); "
                                         f"last log lines:\n{self.stderr_tail()}")

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if not self._ready.is_set() and line.startswith(READY_PREFIX + " "):
                self.address, self.url = line.split()[1:3]
                _say(f"sgl.Runtime: ready at {self.url} (DSL over {self.address}) after "
                     f"{time.monotonic() - self._started:.1f} s")
                self._ready.set()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            line = line.rstrip("\n")
            self._stderr_tail.append(line)
            # The start-up log (model fetch, load, KV memory, address) shows what the wait is for;
            # once serving, only problems are passed on, so a program's own output stays readable.
            if not self._ready.is_set() or any(level in line for level in _PROBLEM_LEVELS):
                _say(line)


_PROBLEM_LEVELS = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _child_env() -> dict[str, str]:
    """The child must import this very sgl_lite, installed or not."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


@atexit.register
def _shutdown_all() -> None:
    for runtime in list(_live_runtimes):
        runtime.shutdown(timeout=5.0)
