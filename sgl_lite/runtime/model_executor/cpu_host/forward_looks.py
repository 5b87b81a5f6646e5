"""What a forward's layers call between them for the thread governor (thread_governor.py): a ForwardWatch
on a multi-threaded forward (has a core been taken? then its remaining layers run on one thread), a
QuietLook on a one-thread forward after a fall (is anything else on the machine runnable? if not, the
fall may end). The thresholds they share with the governor live here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sgl_lite.runtime.model_executor.cpu_host.run_queue import RunQueueWait

STARVED_WAIT = 0.7  # a forward whose threads waited for a CPU longer than this x its wall time had a core taken
SUSTAINED_S = 0.1  # wall time of starved (or slow) forwards in a row before the governor acts on them
LOOK_EVERY_S = 0.02  # a ForwardWatch looks this often (and never before this long)
_QUIET_LOOK_AFTER_S = 0.005  # a one-thread forward after a fall looks for other runnable tasks this far in
_LOADAVG = "/proc/loadavg"


def others_runnable() -> int | None:
    """Tasks runnable on the machine now besides the caller (/proc/loadavg's fourth field counts it too);
    None where that is not known."""
    try:
        with open(_LOADAVG) as f:
            return int(f.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class QuietLook:
    """Between the layers of a one-thread forward after a fall: one look, _QUIET_LOOK_AFTER_S into it (past
    the moment the previous step's tokens wake the HTTP front and its clients), at whether anything else
    is runnable. A look costs a clock read; the one that counts, a read of /proc/loadavg."""

    start: float
    runnable: Callable[[], int | None]
    quiet: bool = False
    looked: bool = False

    def __call__(self) -> None:
        if self.looked or time.perf_counter() - self.start < _QUIET_LOOK_AFTER_S:
            return
        self.looked = True
        self.quiet = self.runnable() == 0


@dataclass
class ForwardWatch:
    """A multi-threaded forward in progress, looked at between its layers: once it has run well past its
    usual time (twice its size's median on this thread count, or _FIRST_LOOK_UNKNOWN_S for a size not yet
    timed) with its threads waiting for a CPU more than STARVED_WAIT of the time, and the starvation has
    lasted SUSTAINED_S (with the starved forwards just before it), the rest of it runs on one
    thread. Why: a neighbour that takes a core mid-run stalls a two-thread forward for many times its
    usual time (docs/performance.md, "Threads in serving"), and waiting for its end to react lost most
    of a benchmark run. A look costs a clock read; past the first, a pread per thread
    every LOOK_EVERY_S."""

    run_queue: RunQueueWait
    start: float
    waited_at_start: float
    next_look: float
    starved_before: float = 0.0  # wall seconds of the starved forwards in a row just before this one
    dropped: bool = False

    def __call__(self) -> None:
        now = time.perf_counter()
        if self.dropped or now < self.next_look:
            return
        self.next_look = now + LOOK_EVERY_S
        waited = self.run_queue.seconds()
        elapsed = now - self.start
        if (waited is not None and waited - self.waited_at_start > STARVED_WAIT * elapsed
                and self.starved_before + elapsed >= SUSTAINED_S):
            torch.set_num_threads(1)
            self.dropped = True
