"""free_port: a port another process binds later, kept off the kernel's ephemeral range (where any
outgoing connection or bind(0) could take it first) and never handed out twice by one process."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from sgl_lite.runtime import free_port as ports
from sgl_lite.runtime.free_port import free_port


def _ephemeral_range() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = f.read().split()
    return int(low), int(high)


@pytest.mark.skipif(not os.path.exists("/proc/sys/net/ipv4/ip_local_port_range"),
                    reason="Linux's ephemeral range is unknown here")
def test_free_ports_lie_below_the_ephemeral_range_and_are_bindable():
    low, _ = _ephemeral_range()
    picked = [free_port() for _ in range(50)]
    assert all(1024 <= p < low for p in picked), picked
    assert len(set(picked)) == len(picked)
    for port in picked[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


class _Scripted:
    """Stands in for random.Random: its choices come from a list (the candidates are what is tested)."""

    def __init__(self, picks: Iterator[int]) -> None:
        self._picks = picks

    def choice(self, candidates: range) -> int:
        port = next(self._picks)
        assert port in candidates
        return port


def test_taken_and_handed_out_ports_are_skipped(monkeypatch):
    handed_out = free_port()
    below = (p for p in range(handed_out - 1, 1024, -1) if ports._bindable("127.0.0.1", p))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", next(below)))
        taken.listen()
        fresh = next(below)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: handed_out + 1)
        monkeypatch.setattr(ports.random, "Random",
                            lambda: _Scripted(iter([taken.getsockname()[1], handed_out, fresh])))
        assert free_port() == fresh


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1500)
    port = free_port()
    assert port >= 1500
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 here")
def test_an_ipv6_host_gets_an_ipv6_port():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = free_port("::1")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))
