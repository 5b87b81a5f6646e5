"""The one "idle and no KV leak" check, for every test and script that runs a runtime.

The rule is the accounting invariant of /work/shared/ARCHITECTURE.md, read from `server_info`: when the
runtime is idle nothing is running, waiting, mid-chunk or waiting for a grammar compile, no prefix in
the radix tree is locked, and every KV slot is free or held evictably by the cache
(free + evictable + protected == total, with protected == 0).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

BUSY_KEYS = ("num_running", "num_waiting", "num_chunked", "num_grammar_pending", "slots_protected")


class HasServerInfo(Protocol):
    def server_info(self) -> dict[str, Any]: ...


def accounting_problems(info: dict[str, Any]) -> list[str]:
    """What breaks the idle accounting invariant in one `server_info` snapshot (empty: none)."""
    problems = [f"{key} = {info[key]}, expected 0" for key in BUSY_KEYS if info[key] != 0]
    if info["slots_free"] + info["slots_evictable"] + info["slots_protected"] != info["slots_total"]:
        problems.append(f"free {info['slots_free']} + evictable {info['slots_evictable']} + protected "
                        f"{info['slots_protected']} != total {info['slots_total']}")
    return problems


def idle_server_info(runtime: HasServerInfo, timeout: float = 15.0) -> dict[str, Any]:
    """Poll `runtime.server_info()` until the invariant holds or `timeout` s pass; the last snapshot.

    Polls because a client sees its reply before the server loop has released the request's slots (and a
    request whose client hung up runs until the loop sees the abort).
    """
    deadline = time.monotonic() + timeout
    while True:
        info = runtime.server_info()
        if not accounting_problems(info) or time.monotonic() >= deadline:
            return info
        time.sleep(0.05)


def assert_idle_without_leaks(runtime: HasServerInfo, timeout: float = 15.0) -> dict[str, Any]:
    """`idle_server_info`, with an AssertionError naming what broke the invariant after `timeout` s."""
    info = idle_server_info(runtime, timeout)
    problems = accounting_problems(info)
    if problems:
        raise AssertionError(f"runtime not idle or KV slots leaked after {timeout} s: {'; '.join(problems)}")
    return info
