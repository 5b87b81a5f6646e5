"""What the thread-governor tests share: a fixture that restores torch's thread count, a driver of forwards
with set times and run-queue waits, and a run-queue account whose waits the test sets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sgl_lite.runtime.model_executor.cpu_host.run_queue import RunQueueWait
from sgl_lite.runtime.model_executor.cpu_host.thread_governor import ThreadGovernor


@pytest.fixture(autouse=True)
def restore_torch_threads() -> Iterator[None]:
    """The governor sets torch's thread count; later tests get the count they started with."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def drive_with_waits(governor: ThreadGovernor, num_tokens: int, seconds: dict[int, float], waits: dict[int, float],
                     forwards: int) -> list[int]:
    """Run `forwards` forwards whose time and whose threads' run-queue wait (`waits[threads]` x its wall
    time) depend only on the thread count; the counts chosen, in order."""
    chosen = []
    for _ in range(forwards):
        threads = governor.choose(num_tokens)
        governor.record(num_tokens, threads, seconds[threads], waits[threads] * seconds[threads])
        chosen.append(threads)
    return chosen


class ControlledRunQueue(RunQueueWait):
    """A run-queue account whose waits the test sets (a neighbour's effect, without a neighbour)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0

    def watch(self, tids: list[int]) -> None:
        pass

    def seconds(self) -> float:
        return self.total
