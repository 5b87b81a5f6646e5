"""A child process that dies with its parent: `sgl-lite serve` under `sgl.Runtime()` or a cluster, and
the HTTP front under `serve`; and the parent's side, stopping such a child.

A watch thread polls the parent pid instead of prctl(PR_SET_PDEATHSIG): the death signal fires when
the *thread* that forked the child exits, so a Runtime created in a worker thread would lose its
server with that thread. When the parent is gone (any way: exit, SIGTERM, SIGKILL, a notebook
kernel restart) the child is re-parented, which `os.getppid()` shows within one poll.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def exit_with_parent(parent_pid: int, on_parent_death: Callable[[], None]) -> None:
    """Call `on_parent_death` (in a daemon thread) once `parent_pid` is no longer our parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        logger.warning("parent process %d is gone; exiting", parent_pid)
        on_parent_death()

    threading.Thread(target=watch, name="sgl-lite-parent-watch", daemon=True).start()


def stop_child(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM `process` (a graceful stop), SIGKILL it if it has not exited within `timeout` s, and reap it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
