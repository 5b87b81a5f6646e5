"""OpenMP's wait policy for runtime processes on a shared CPU box (torch-free: it must run before torch loads).

By default libgomp makes every thread spin at the end of each parallel region before it sleeps. A decode
step runs hundreds of short regions (every matmul, norm and attention call of every layer), so when
another process holds one of the cores, the spinning threads burn the time slices the descheduled thread
needs and throughput collapses. Measured with `python scripts/bench_threads.py` on a 2-core box shared
with other work (load ~25; see README "Threads on a shared box"): decode at batch 8 ran at 1.4 tok/s with
the default policy against 175 tok/s with OMP_WAIT_POLICY=passive. libgomp reads the variable once,
when torch loads it, so runtime entry points call `prefer_passive_wait()` before importing torch; a value
the user set wins.
"""

from __future__ import annotations

import os
import sys


def prefer_passive_wait() -> bool:
    """Default OMP_WAIT_POLICY to passive for this process and its children; False if torch is already loaded."""
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    return "torch" not in sys.modules
