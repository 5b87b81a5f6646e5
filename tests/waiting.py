"""Waiting in a test for what another thread or process does: poll a condition until it holds or a deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable


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
