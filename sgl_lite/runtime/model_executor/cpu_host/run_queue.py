"""How long the threads running a forward waited for a CPU: the scheduler's own account of contention.

Linux keeps, per thread, the time it spent runnable but not running (`/proc/self/task/<tid>/schedstat`,
second field, nanoseconds). Over one forward, that time summed over the threads running it (the calling
thread and torch's parallel-region workers) says whether a core was taken from it: on a free box a
two-thread decode forward's threads wait a small share of its wall time, with a neighbour spinning on one
core most of it, at batch 1 and 8 alike (counting every thread of the process). The process's other
threads are left out: with another thread of the process runnable (an in-process client decoding text,
say) the process waited about a third of some forwards on a free box. CPU time is no such signal either: when
another Python thread holds the GIL the forward's threads idle too, which lowers it as a lost core does.

Reading it costs a pread per watched thread on descriptors kept open; where schedstat does not exist
`seconds()` is None.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

TASKS = "/proc/self/task"


def forward_thread_ids() -> list[int]:
    """The calling thread and the threads of torch's parallel regions at the current thread count (every
    thread of the process when the C++ ops that name them are not built)."""
    from sgl_lite.runtime.kernels import ops
    from sgl_lite.runtime.kernels.loader import has_op

    if not has_op("parallel_thread_ids"):
        return [int(tid) for tid in os.listdir(TASKS)]
    workers = [tid for tid in ops.parallel_thread_ids() if tid >= 0]
    return sorted({threading.get_native_id(), *workers})


@dataclass
class RunQueueWait:
    """Total seconds a set of this process's threads have waited on the run queue, read cheaply and often."""

    _fds: dict[int, int] = field(default_factory=dict)
    available: bool = field(default_factory=lambda: os.path.exists(f"{TASKS}/{os.getpid()}/schedstat"))

    def watch(self, tids: Iterable[int]) -> None:
        """Read these threads from now on (ids of threads that have exited are dropped)."""
        if not self.available:
            return
        wanted = set(tids)
        for tid in self._fds.keys() - wanted:
            os.close(self._fds.pop(tid))
        for tid in wanted - self._fds.keys():
            try:
                self._fds[tid] = os.open(f"{TASKS}/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                pass  # exited meanwhile

    def seconds(self) -> float | None:
        """The watched threads' summed run-queue wait so far (None where Linux does not keep it). A thread
        that exits takes its share with it, so differences can be negative: read them as no wait."""
        if not self.available:
            return None
        total = 0
        for tid, fd in list(self._fds.items()):
            try:
                total += int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):  # the thread exited
                os.close(self._fds.pop(tid))
        return total / 1e9

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
