"""A port that is free now, for another process to bind later (sglang-router, torch's TP rendezvous).

Picked below the kernel's ephemeral range: a port from inside it (what bind(host, 0) returns) can be
taken before that process binds it by any outgoing connection or bind(0) on the machine, and gloo's
tensor-parallel ranks open dozens of those while a cluster starts (a CI run lost its router's port so).
Imports nothing of sgl_lite: the TP launcher (model_executor) and the cluster (a tool) both use it.
Beside it, how a host is written where others connect to it (`connect_host`, `url_host`), for every
layer that announces an address.
"""

from __future__ import annotations

import random
import socket

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_FREE_PORT_SPAN = 12000  # how far below the kernel's ephemeral range free_port looks
_FREE_PORT_TRIES = 64
_handed_out: set[int] = set()  # ports free_port returned in this process, never returned twice


def free_port(host: str = "127.0.0.1") -> int:
    """A port bindable now on `host`, below the ephemeral range when there is room, never one this
    process handed out before; else the kernel's pick."""
    low = _ephemeral_low()
    candidates = range(max(1024, low - _FREE_PORT_SPAN), low)
    rng = random.Random()
    for _ in range(_FREE_PORT_TRIES if len(candidates) > 1000 else 0):
        port = rng.choice(candidates)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    with socket.socket(address_family(host), socket.SOCK_STREAM) as s:  # no room below the range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def address_family(host: str) -> socket.AddressFamily:
    """IPv6 for a host written with colons, else IPv4."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def connect_host(host: str) -> str:
    """Where a client reaches a server bound to `host`: a wildcard bind through loopback."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def url_host(host: str) -> str:
    """`host` as a URL or a ZeroMQ tcp:// endpoint writes it: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bindable(host: str, port: int) -> bool:
    with socket.socket(address_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
