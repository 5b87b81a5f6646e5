"""`sgl-lite serve --dp N`: N runtime replicas, each with its HTTP front, behind SGLang's own router.

Data parallelism uses existing engines (docs/scale-out.md): every replica is an ordinary
`sgl-lite serve` process, whose HTTP front speaks SGLang's worker API (sgl_lite.http), and
`sglang-router` (pip install sglang-router==0.3.2) routes between them, by default with its cache-aware
policy, which sends a request to the replica whose radix cache most likely holds its prefix.

Placement: the CPUs this process may use are split into N disjoint sets, one per replica (its
affinity mask, OMP_NUM_THREADS and hence torch's intra-op thread count), so that replicas do not
fight over cores. With more replicas than CPUs, replicas share CPUs one thread each.

Only the router listens outside (on --host/--port); replicas bind loopback on free ports.
SIGINT/SIGTERM stop the router first (no new requests), then the replicas (each stops its front).
Replicas watch this process: if it dies without stopping them, they exit too (each with its front).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from types import FrameType
from typing import Callable

from sgl_lite.runtime.free_port import connect_host, free_port, url_host
from sgl_lite.runtime.server_args import API_KEY_ENV, ServerArgs

logger = logging.getLogger(__name__)

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
READY_PREFIX = "SGL_LITE_CLUSTER_READY"
_LOOPBACK = "127.0.0.1"
_STOP_TIMEOUT_S = 10.0
# sglang-router's launcher (`python -m sglang_router.launch_router`) reads its key only from
# `--api-key`: this runs the same launcher with the key from the environment instead.
_ROUTER_BOOTSTRAP = ("import os, sys; from sglang_router.launch_router import launch_router, parse_router_args; "
                     "router_args = parse_router_args(sys.argv[1:]); "
                     f"router_args.api_key = os.environ.get({API_KEY_ENV!r}) or router_args.api_key; launch_router(router_args)")


class ClusterError(RuntimeError):
    """A replica, front or the router failed to start (the message names which, with its last log lines)."""


def cpu_sets(dp: int, cpus: list[int] | None = None) -> list[list[int]]:
    """Split the usable CPUs into `dp` disjoint, contiguous sets (round-robin sharing when dp > #cpus)."""
    if dp < 1:
        raise ValueError(f"--dp must be >= 1; got {dp}")
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if dp >= len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(dp)]
    base, extra = divmod(len(cpus), dp)
    sets, start = [], 0
    for i in range(dp):
        size = base + (1 if i < extra else 0)
        sets.append(cpus[start:start + size])
        start += size
    return sets


def _last_value(cmd: list[str], flag: str) -> str | None:
    """The value of the last `flag` in `cmd` (extra router args given later override ours)."""
    values = [cmd[i + 1] for i, arg in enumerate(cmd[:-1]) if arg == flag]
    return values[-1] if values else None


def router_command(worker_urls: list[str], host: str, port: int, policy: str, log_level: str = "info") -> list[str]:
    """The sglang-router command line for `worker_urls` (its metrics on a free loopback port).

    The router takes its API key from SGL_LITE_API_KEY in its environment (none when unset), never
    from this command line, which any local user can read with `ps`.
    """
    # cache_aware balances load only when replicas differ by more than --balance-abs-threshold requests
    # in flight (64 by default): agent sessions sharing a long system prompt would all match one replica
    # and leave the others idle (measured in docs/performance.md, "Scale-out: replicas behind sglang-router"). At 1
    # it sends a request to the least-loaded replica whenever loads differ by 2+ requests (and by 1.5x),
    # else by cache match: in those agent runs first turns spread evenly and later turns kept their
    # cache. Flags given later (router_args) override this.
    balance = ["--balance-abs-threshold", "1"] if policy == "cache_aware" else []
    return [sys.executable, "-c", _ROUTER_BOOTSTRAP, "--host", host, "--port", str(port),
            "--policy", policy, *balance, "--worker-urls", *worker_urls,
            "--prometheus-host", _LOOPBACK, "--prometheus-port", str(free_port()),
            "--log-level", {"warning": "warn"}.get(log_level, log_level)]


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[str]
    log_tail: list[str] = field(default_factory=list)

    def tail(self) -> str:
        return "\n".join(self.log_tail[-30:])


class Cluster:
    """The processes of one `serve --dp N`; `start()` returns once the router answers, `stop()` ends all."""

    def __init__(self, args: ServerArgs, dp: int, router_policy: str = "cache_aware", *,
                 served_model_name: str | None = None,
                 startup_timeout: float = 600.0, router_args: list[str] | None = None) -> None:
        """The router listens on args.host:args.port; `router_args` are extra sglang-router flags
        (health-check interval, retries, circuit breaker ...)."""
        if router_policy not in ROUTER_POLICIES:
            raise ValueError(f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}; got {router_policy!r}")
        self.args = args
        self.dp = dp
        self.http_port = args.port
        self.http_host = args.host
        self.served_model_name = served_model_name
        self.router_policy = router_policy
        self.startup_timeout = startup_timeout
        self.router_args = list(router_args or [])
        self.replicas: list[_Child] = []
        self.router: _Child | None = None
        self.worker_urls: list[str] = []
        self.metrics_urls: list[str] = []  # each replica's /metrics, then the router's

    @property
    def url(self) -> str:
        return f"http://{url_host(connect_host(self.http_host))}:{self.http_port}"

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        if importlib.util.find_spec("sglang_router") is None:
            raise ClusterError("--dp-size > 1 runs sglang-router, which is not installed: "
                               "pip install 'sgl-lite[router]' (or sglang-router==0.3.2)")
        from sgl_lite.runtime.server.ports import check_port_free

        if self.http_port == 0:  # "pick a free one", as `serve --port 0` does; the router needs it given
            self.http_port = free_port(self.http_host)
        check_port_free(self.http_host, self.http_port, "sglang-router", "--port")  # before any replica loads
        deadline = time.monotonic() + self.startup_timeout
        for i, cpus in enumerate(cpu_sets(self.dp)):
            self.replicas.append(self._spawn_replica(i, cpus))
        self.worker_urls = [self._wait_replica_ready(r, deadline) for r in self.replicas]
        for replica, url in zip(self.replicas, self.worker_urls):
            _wait_http_ok(url + "/health", replica, deadline, self.args.api_key)
        cmd = router_command(self.worker_urls, self.http_host, self.http_port, self.router_policy,
                             self.args.log_level) + self.router_args
        # sglang-router has no parent watch of its own (replicas get --parent-pid): without this, a SIGKILLed
        # `serve` left it holding the public port, in front of no workers.
        self.router = _spawn("router", cmd, env=self._env(threads=None), preexec_fn=dies_with(os.getpid()))
        _wait_http_ok(self.url + "/health", self.router, deadline, None)
        _wait_router_workers(self.url, len(self.worker_urls), self.router, deadline, self.args.api_key)
        logger.info("cluster ready: router (%s) on %s over %d replicas %s", self.router_policy, self.url,
                    self.dp, ", ".join(self.worker_urls))
        # A Prometheus scrapes each replica (SGLang's sglang:* names, one series set per replica) and the router.
        router_metrics = f"http://{_last_value(cmd, '--prometheus-host')}:{_last_value(cmd, '--prometheus-port')}/metrics"
        self.metrics_urls = [url + "/metrics" for url in self.worker_urls] + [router_metrics]
        logger.info("metrics: replicas %s; sglang-router %s", ", ".join(self.metrics_urls[:-1]), router_metrics)

    def _spawn_replica(self, index: int, cpus: list[int]) -> _Child:
        from sgl_lite.lang.launcher import serve_command

        cmd = serve_command(self.args.replace(host=_LOOPBACK, port=0, zmq_port=None)) + ["--parent-pid", str(os.getpid())]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]  # the router labels workers by it
        # Affinity is set in the child before it imports torch, so every thread it starts inherits it.
        return _spawn(f"replica {index} (cpus {cpus})", cmd, env=self._env(threads=len(cpus)),
                      preexec_fn=lambda: os.sched_setaffinity(0, cpus), stdout=subprocess.PIPE)

    def _env(self, threads: int | None) -> dict[str, str]:
        """A child's environment; the API key travels here, never on a command line (`ps` shows those)."""
        from sgl_lite.lang.launcher import api_key_env

        return api_key_env(_child_env(threads), self.args.api_key, self.args.admin_api_key)

    def _wait_replica_ready(self, replica: _Child, deadline: float) -> str:
        """The replica's HTTP URL, once it has announced it."""
        from sgl_lite.runtime.protocol import READY_PREFIX as RUNTIME_READY

        ready = threading.Event()
        address: list[str] = []

        def read_stdout() -> None:
            assert replica.process.stdout is not None
            for line in replica.process.stdout:
                if not ready.is_set() and line.startswith(RUNTIME_READY + " "):
                    address.append(line.split()[-1])
                    ready.set()

        threading.Thread(target=read_stdout, name=f"{replica.name} stdout", daemon=True).start()
        while not ready.wait(0.05):
            _check_alive(replica)
            if time.monotonic() > deadline:
                raise ClusterError(f"{replica.name} not ready in time; last log lines:\n{replica.tail()}")
        return address[0]

    def stop(self) -> None:
        """Router first (no new requests reach a stopping replica), then the replicas."""
        for group in ([self.router] if self.router else [], self.replicas):
            for child in group:
                if child.process.poll() is None:
                    child.process.terminate()
            for child in group:
                try:
                    child.process.wait(_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()

    def wait(self) -> int:
        """Block until the router exits (or a signal stops the cluster); return its exit code."""
        assert self.router is not None
        return self.router.process.wait()


def launch_cluster(args: ServerArgs, dp: int, router_policy: str = "cache_aware", *,
                   served_model_name: str | None = None, router_args: list[str] | None = None) -> int:
    """Run a cluster in the foreground until SIGINT/SIGTERM; return the exit code for the CLI.

    Only the router listens on args.host/args.port; replicas bind loopback on free ports.
    """
    cluster = Cluster(args, dp, router_policy, served_model_name=served_model_name, router_args=router_args)
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stopping.is_set():
            stopping.set()
            logger.info("signal %d: stopping the cluster", signum)
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start()
        print(f"{READY_PREFIX} {cluster.url}", flush=True)
        code = cluster.wait()
        if not stopping.is_set():
            logger.error("the router exited with code %d; stopping the replicas", code)
            return code or 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        # Signals stay ignored while children stop: a second Ctrl-C must not leave orphans behind.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def dies_with(parent_pid: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when its parent dies (Linux's parent-death signal; elsewhere,
    nothing), and ends at once if the parent is already gone. The signal follows the thread that forks
    it: start such children from a thread that lives as long as they should (the main thread)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # died before the signal was set
            os.kill(os.getpid(), signal.SIGTERM)

    return in_child


def _spawn(name: str, cmd: list[str], *, env: dict[str, str] | None = None,
           preexec_fn: Callable[[], None] | None = None, stdout: int | None = None) -> _Child:
    """Start `cmd` in a session of its own (a terminal's Ctrl-C reaches the cluster alone, which stops the
    router before the replicas; a router that took it too exited first and was logged as having failed);
    its stderr (the logs) is kept in a bounded tail, and also echoed to ours."""
    process = subprocess.Popen(cmd, stdout=stdout if stdout is not None else subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=env or _child_env(threads=None),
                               preexec_fn=preexec_fn, start_new_session=True)
    child = _Child(name, process)

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            child.log_tail.append(line.rstrip("\n"))
            del child.log_tail[:-200]
            sys.stderr.write(f"[{name}] {line}")

    threading.Thread(target=read_stderr, name=f"{name} stderr", daemon=True).start()
    logger.info("started %s: pid %d", name, process.pid)
    return child


def _child_env(threads: int | None) -> dict[str, str]:
    from pathlib import Path

    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _check_alive(child: _Child) -> None:
    if child.process.poll() is not None:
        time.sleep(0.2)  # let the stderr reader catch the last lines
        raise ClusterError(f"{child.name} exited with code {child.process.returncode}; "
                           f"last log lines:\n{child.tail()}")


def _http_status(url: str, api_key: str | None) -> int | None:
    request = urllib.request.Request(url, headers=_auth_headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=2.0) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def _wait_http_ok(url: str, child: _Child, deadline: float, api_key: str | None) -> None:
    while _http_status(url, api_key) != 200:
        _check_alive(child)
        if time.monotonic() > deadline:
            raise ClusterError(f"{child.name}: {url} not answering 200 in time; last log lines:\n{child.tail()}")
        time.sleep(0.1)


def _wait_router_workers(router_url: str, expected: int, router: _Child, deadline: float,
                         api_key: str | None) -> None:
    """The router registers workers in the background: wait until all are healthy in its registry."""
    import json

    while True:
        try:
            request = urllib.request.Request(router_url + "/workers", headers=_auth_headers(api_key))
            with urllib.request.urlopen(request, timeout=2.0) as response:
                workers = json.loads(response.read()).get("workers", [])
            if sum(1 for w in workers if w.get("is_healthy")) >= expected:
                return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        _check_alive(router)
        if time.monotonic() > deadline:
            raise ClusterError(f"router did not register {expected} healthy workers in time; "
                               f"last log lines:\n{router.tail()}")
        time.sleep(0.1)


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
