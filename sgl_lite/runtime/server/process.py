"""The `sgl-lite serve` process around the transport: load, bind, announce readiness, serve, exit.

`run_server` is the process's main: RuntimeCore from the flags, the ZeroMQ socket bound (before the
HTTP front starts, so a port clash is one line), signals wired to a graceful stop, the ready line on
stdout that launchers wait for, then `RuntimeServer.serve_forever` until a signal. `--watchdog-timeout`
ends a process whose scheduler step hangs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

import zmq

from sgl_lite.runtime.protocol import READY_PREFIX
from sgl_lite.runtime.server.event_loop import RuntimeServer
from sgl_lite.runtime.server.ports import PortUnavailableError
from sgl_lite.runtime.server_args import ServerArgs, warn_if_exposed

if TYPE_CHECKING:
    from sgl_lite.runtime.server.core import RuntimeCore

logger = logging.getLogger("sgl_lite.runtime.server.event_loop")


def run_server(args: ServerArgs, after_bind: Callable[[Callable[[], None]], list[str]] | None = None,
               zmq_fd: int | None = None) -> None:
    """The `sgl-lite serve` process: load the model, bind, announce readiness, serve until a signal.

    `after_bind(request_shutdown)` runs once the ZeroMQ socket is bound, before the ready line: `serve`
    waits there for its HTTP front, and returns the addresses to announce after ours (the HTTP URL).
    The ready line `SGL_LITE_READY <zmq address> [<http url>]` on stdout is what the launcher waits
    for; everything else goes to the log (stderr). `zmq_fd`: a socket already listening on the ZeroMQ
    port (ports.claim_ports), which the ROUTER takes over.
    """
    from sgl_lite.runtime.server.core import RuntimeCore

    try:
        core = RuntimeCore.from_args(args)
    except BaseException:
        if zmq_fd is not None:  # not handed to a ROUTER yet: ours to close
            os.close(zmq_fd)
        raise
    server = RuntimeServer(core, args)
    try:
        address = server.bind(zmq_fd)
    except zmq.ZMQError as e:
        core.close()
        raise PortUnavailableError(f"cannot bind the ZeroMQ endpoint (--host/--zmq-port): {e}") from None
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: server.request_shutdown())
    announced = [address]
    if after_bind is not None:
        try:
            announced += after_bind(server.request_shutdown)
        except BaseException:
            server.request_shutdown()
            server.serve_forever()  # returns at once: closes the socket
            core.close()
            raise
    if server.stop_requested:  # a signal while the front started: stop without announcing a server that ends
        logger.info("stopping before serving (signal during the start)")
    else:
        _start_watchdog(server, core, args.watchdog_timeout)
        # RuntimeCore.from_args has logged the model, dtype, parameters, KV slots and bytes and policy.
        logger.info("listening on %s%s", " and ".join(announced), " (api key required)" if args.api_key else "")
        warn_if_exposed(args.host, args.api_key, "the runtime")
        print(READY_PREFIX, *announced, flush=True)
        logger.info("ready")
    try:
        server.serve_forever()
    finally:
        core.close()  # the tensor-parallel ranks and the tokenizer thread
    logger.info("server stopped")
    if core.is_compiling_grammar():
        # A compile thread still waits on its worker process (which core.close() killed): every
        # client has been answered, so leave at once rather than through the interpreter's slow
        # teardown. The HTTP front notices its parent's exit (parent watch) and exits too.
        logger.info("exiting without waiting for a grammar compile")
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)


def _start_watchdog(server: RuntimeServer, core: RuntimeCore, timeout: float) -> None:
    """--watchdog-timeout: a step that runs longer (a hung forward, a deadlocked collective) ends the
    process, as SGLang's watchdog does; clients see the connection drop at once, and a supervisor can
    restart the server, instead of everyone waiting on a server that answers heartbeats but never steps.
    So does losing a tensor-parallel rank."""

    def watch() -> None:
        while True:
            time.sleep(min(1.0, timeout / 4))
            started = server.step_started_at
            if started is not None and time.monotonic() - started > timeout:
                logger.error("a scheduler step has run for more than --watchdog-timeout %g s; exiting", timeout)
                logging.shutdown()
                os._exit(1)
            # Without a rank every forward fails, while heartbeats and /health still answer: a server that
            # looks alive to a router and serves nothing. Exit, as for a hung step.
            lost = core.lost_ranks()
            if lost is not None:
                logger.error("%s; exiting", lost)
                logging.shutdown()
                os._exit(1)

    threading.Thread(target=watch, name="sgl-lite-watchdog", daemon=True).start()
