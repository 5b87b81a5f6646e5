"""Waiting in a test for what another thread or process does: poll a condition until it holds or a deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path


def wait_until(condition: Callable[[], object], what: str | Callable[[], object], seconds: float = 30.0,
               poll_s: float = 0.02) -> None:
    """Return as soon as `condition()` is true; fail the test once `seconds` have passed without it.

    `what` names what was awaited in the failure's message; a callable is called then, to show the state
    that kept the condition false (the processes still alive, the pins still held)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {seconds:g} s for {what() if callable(what) else what}")
        time.sleep(poll_s)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs: listed in /proc and not a zombie (a zombie has exited; its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until_exited(pids: Iterable[int], seconds: float) -> None:
    """Return once none of `pids` runs; fail naming those still running after `seconds`."""
    pids = list(pids)
    wait_until(lambda: not any(process_alive(pid) for pid in pids),
               lambda: f"every process to exit; alive: {[pid for pid in pids if process_alive(pid)]}", seconds, poll_s=0.1)
