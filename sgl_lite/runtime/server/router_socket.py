"""The runtime's ZeroMQ ROUTER socket: its options and why each is set, its bind (tcp on IPv4 or IPv6, a free
port for port 0; ipc on an owner-only socket file), and the removal of that file when it closes."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import zmq

from sgl_lite.runtime.free_port import url_host
from sgl_lite.runtime.server.zap import KeyAuthenticator, require_handshake
from sgl_lite.runtime.server_args import ServerArgs


@dataclass
class RouterSocket:
    socket: zmq.Socket
    address: str  # what clients connect to: tcp://host:port or ipc://path
    socket_file: tuple[str, int] | None  # an ipc endpoint's file and its inode
    authenticator: KeyAuthenticator | None = None  # admits the peers that may connect (zap.py)

    def close(self, linger_ms: int) -> None:
        self.socket.close(linger=linger_ms)
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
        if self.socket_file is not None:  # ZeroMQ leaves an ipc socket's file behind; remove ours, not a successor's
            path, inode = self.socket_file
            self.socket_file = None
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == inode:
                    os.unlink(path)


def bind_router(context: zmq.Context, args: ServerArgs, listening_fd: int | None = None) -> RouterSocket:
    """A ROUTER bound on args.host (and --zmq-port for tcp); zmq.ZMQError when the address is taken.
    `listening_fd`: a tcp socket already listening on that address (ports.claim_ports), which libzmq takes
    over (ZMQ_USE_FD) and closes with the ROUTER."""
    sock = context.socket(zmq.ROUTER)
    authenticator = None
    try:
        # Peers pass a PLAIN handshake (with the api_key as its password, if there is one: one without it is
        # dropped before libzmq queues a byte it sends); the handler runs before the ROUTER binds.
        authenticator = require_handshake(context, sock, args.api_key)
        router = _bind(sock, args, listening_fd)
    except BaseException:
        sock.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        raise
    router.authenticator = authenticator
    return router


def _bind(sock: zmq.Socket, args: ServerArgs, listening_fd: int | None) -> RouterSocket:
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # Clients use a fixed routing id; a reconnect (after a dropped connection) takes it over.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # A bounded send queue per peer: a peer that stops reading is dropped once this many replies
    # wait for it (sending raises EAGAIN, see RuntimeServer._send), so it cannot grow the server without bound.
    sock.setsockopt(zmq.SNDHWM, args.max_queued_replies_per_client)
    # An unbounded receive queue: with a high-water mark, a burst of requests on one connection
    # stalls libzmq's reading of that connection, and the client's ZMTP heartbeats queue behind
    # the data until it declares a live runtime dead. Memory is then what the admitted peers send (each
    # frame is capped below, their number is not: with --api-key, only peers holding the key get this far);
    # the loop reads at most MAX_MESSAGES_PER_STEP per step.
    sock.setsockopt(zmq.RCVHWM, 0)
    # Frames up to twice the limit are read (a message over the limit is refused with an ErrorReply naming
    # it); larger ones are cut off by ZeroMQ itself (connection dropped, no reply possible). The limit is
    # per frame: the loop drops a message's frames past the second as it reads them (RuntimeServer._receive).
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * args.max_message_bytes)
    host = args.host
    if host.startswith("ipc://"):
        # Owner-only from the moment the socket file exists (the umask), and after (the chmod).
        previous_umask = os.umask(0o177)
        try:
            sock.bind(host)
        finally:
            os.umask(previous_umask)
        path = host[len("ipc://") :]
        if path.startswith("@"):  # an abstract name (Linux) has no file
            return RouterSocket(sock, host, None)
        os.chmod(path, 0o600)
        return RouterSocket(sock, host, (path, os.stat(path).st_ino))
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)  # else libzmq refuses an IPv6 address ("No such device")
    port = args.resolved_zmq_port()
    if port == 0:
        port = sock.bind_to_random_port(f"tcp://{url_host(host)}")
        return RouterSocket(sock, f"tcp://{url_host(host)}:{port}", None)
    address = f"tcp://{url_host(host)}:{port}"
    if listening_fd is not None:
        sock.setsockopt(zmq.USE_FD, listening_fd)
    sock.bind(address)
    return RouterSocket(sock, address, None)
