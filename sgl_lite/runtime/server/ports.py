"""The ports of `sgl-lite serve`, claimed before the model loads, so that a clash costs one line at once
instead of a traceback after a long load.

Both ports are bound and listening here, and their file descriptors handed over, so nobody can take
either in between: the HTTP one to the HTTP front, the ZeroMQ one to the runtime's ROUTER (libzmq's
ZMQ_USE_FD; it owns and closes the fd from then on). A socket merely bound (not listening) kept only
some programs off: another SO_REUSEADDR listener could still take the port during the model's load,
and the runtime's bind failed after it. Connections that arrive before the hand-over wait in the
listen backlog.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from sgl_lite.runtime.free_port import address_family
from sgl_lite.runtime.server_args import ServerArgs

LISTEN_BACKLOG = 2048  # uvicorn's default


class PortUnavailableError(RuntimeError):
    """A port the server needs is taken (the message names the flag)."""


@dataclass
class ClaimedPorts:
    http_socket: socket.socket  # listening; its fd goes to the HTTP front
    zmq_socket: socket.socket | None  # listening; its fd goes to the ROUTER. None for an ipc:// endpoint
    args: ServerArgs  # with the concrete --port and --zmq-port

    def take_zmq_fd(self) -> int | None:
        """The ZeroMQ listener's fd, for RuntimeServer.bind, which owns it from then on (None for ipc)."""
        if self.zmq_socket is None:
            return None
        fd = self.zmq_socket.detach()
        self.zmq_socket = None
        return fd

    def close(self) -> None:
        if self.zmq_socket is not None:
            self.zmq_socket.close()
            self.zmq_socket = None
        self.http_socket.close()


def http_bind_host(args: ServerArgs) -> str:
    """Where HTTP listens: --host, or loopback when --host is an ipc:// path (ZeroMQ's only)."""
    return "127.0.0.1" if args.host.startswith("ipc://") else args.host


def claim_ports(args: ServerArgs) -> ClaimedPorts:
    """Bind and listen on the HTTP and ZeroMQ ports; PortUnavailableError names the one taken."""
    host = http_bind_host(args)
    http_socket = _bind(host, args.port, "HTTP", "--port")
    http_socket.listen(LISTEN_BACKLOG)
    http_port = http_socket.getsockname()[1]
    if args.host.startswith("ipc://"):
        try:
            check_ipc_path_free(args.host[len("ipc://"):])
        except PortUnavailableError:
            http_socket.close()
            raise
        return ClaimedPorts(http_socket, None, args.replace(port=http_port))
    zmq_port = args.zmq_port if args.zmq_port is not None else (http_port + 1 if args.port else 0)
    try:
        zmq_socket = _bind(host, zmq_port, "the ZeroMQ endpoint",
                           "--zmq-port" if args.zmq_port is not None else "--port + 1; choose another with --zmq-port")
    except PortUnavailableError:
        http_socket.close()
        raise
    zmq_socket.listen(LISTEN_BACKLOG)
    return ClaimedPorts(http_socket, zmq_socket, args.replace(port=http_port, zmq_port=zmq_socket.getsockname()[1]))


def check_ipc_path_free(path: str) -> None:
    """Fail if a server answers on this socket path: ZeroMQ would unlink it and bind over it, leaving that
    server running and unreachable. A file nobody answers on (a server that was killed) is fine."""
    if path.startswith("@"):  # Linux's abstract namespace: the bind itself fails when it is taken
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # no such file, or nobody listening
    finally:
        probe.close()
    raise PortUnavailableError(f"cannot use ipc://{path} (--host): a running server listens there")


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    """Fail now if (host, port) cannot be bound (for a process that binds it itself later)."""
    _bind(host, port, what, flag).close()


def _bind(host: str, port: int, what: str, flag: str) -> socket.socket:
    sock = socket.socket(address_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortUnavailableError(f"cannot use {host}:{port} for {what} ({flag}): {e.strerror or e}") from None
    return sock
