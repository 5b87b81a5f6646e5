"""How long this process's threads have waited for a CPU: the scheduler's own account of contention.

Linux keeps, per thread, the time it spent runnable but not running (`/proc/self/task/<tid>/schedstat`,
second field, nanoseconds). Over one forward, that time summed over the process's threads says whether
a core was taken from it: on a free 2-core box a two-thread decode forward's threads waited 0-13% of its
wall time, with a neighbour spinning on one core 45-89% (measured at batch 1 and 8). The process's CPU
time is no such signal: when another Python thread holds the GIL the forward's threads idle too, which
lowers it just as a lost core does.

Reading it costs a pread per thread on descriptors kept open (the thread list is re-read every
RESCAN_EVERY calls: threads come and go); where schedstat does not exist `seconds()` is None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

TASKS = "/proc/self/task"
RESCAN_EVERY = 64


@dataclass
class RunQueueWait:
    """Total seconds the process's live threads have waited on the run queue, read cheaply and often."""

    _fds: dict[str, int] = field(default_factory=dict)
    _calls: int = 0
    available: bool = field(default_factory=lambda: os.path.exists(f"{TASKS}/{os.getpid()}/schedstat"))

    def seconds(self) -> float | None:
        """The live threads' summed run-queue wait so far (None where Linux does not keep it). A thread that
        exits takes its share with it, so differences can be negative: read them as no wait."""
        if not self.available:
            return None
        if self._calls % RESCAN_EVERY == 0:
            self._rescan()
        self._calls += 1
        total = 0
        for tid, fd in list(self._fds.items()):
            try:
                total += int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):  # the thread exited
                os.close(fd)
                del self._fds[tid]
        return total / 1e9

    def _rescan(self) -> None:
        try:
            tids = set(os.listdir(TASKS))
        except OSError:
            self.available = False
            return
        for tid in tids - self._fds.keys():
            try:
                self._fds[tid] = os.open(f"{TASKS}/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                pass  # exited meanwhile

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
