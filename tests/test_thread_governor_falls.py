"""The thread governor's falls to one thread, of every size at once, and their early ends when nothing else
on the machine is runnable (test_thread_governor.py: the probes and verdicts of each size)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from governor_drives import ControlledRunQueue, drive_with_waits, restore_torch_threads  # noqa: F401 (an autouse fixture)

from sgl_lite.runtime.model_executor.cpu_host.thread_governor import SUSTAINED_S, ThreadGovernor


class _Machine:
    """What the governor's QuietLook reads: how many other tasks are runnable (the test sets it)."""

    def __init__(self, others: int | None) -> None:
        self.others = others
        self.looks = 0

    def __call__(self) -> int | None:
        self.looks += 1
        return self.others


def _fall_after_a_free_box(governor: ThreadGovernor) -> None:
    """Decode steps and a prefill size on two threads, a batch-1 size on one, then a lasting starvation."""
    free = {2: 0.0, 1: 0.0}
    for _ in range(40):
        drive_with_waits(governor, 8, {2: 0.004, 1: 0.005}, free, 1)
        drive_with_waits(governor, 300, {2: 0.040, 1: 0.070}, free, 1)
        drive_with_waits(governor, 1, {2: 0.004, 1: 0.003}, free, 1)
    assert governor.summary()["threads_by_min_tokens"] == {1: 1, 8: 2, 256: 2}
    governor.min_probe_interval = 64  # no probe within the test from here on: only the fall and its end
    drive_with_waits(governor, 8, {2: SUSTAINED_S, 1: 0.005}, {2: 0.9, 1: 0.0}, 1)
    assert governor.summary()["threads_by_min_tokens"] == {1: 1, 8: 1, 256: 1}


def _one_thread_forward(governor: ThreadGovernor, num_tokens: int, layers: int = 4) -> int:
    """One forward through governor.forward whose layers take 3 ms each; the thread count it ran on."""
    with governor.forward(num_tokens) as between_layers:
        threads = torch.get_num_threads()
        for _ in range(layers):
            time.sleep(0.003)
            if between_layers is not None:
                between_layers()
    return threads


def test_a_fall_ends_at_the_first_one_thread_forward_that_finds_nothing_else_runnable():
    machine = _Machine(others=1)  # the HTTP front still busy with a turn's prompts
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2, runnable=machine,
                               run_queue=ControlledRunQueue())
    _fall_after_a_free_box(governor)
    assert [_one_thread_forward(governor, 8) for _ in range(3)] == [1, 1, 1]
    assert machine.looks == 3  # one look a forward
    machine.others = 0  # the burst is over
    assert _one_thread_forward(governor, 8) == 1
    # every size back where it was, the batch-1 size on the one thread its own probe chose
    assert governor.summary()["threads_by_min_tokens"] == {1: 1, 8: 2, 256: 2}
    assert governor.choose(5000) == 2  # and a size first seen now starts from the verdict before the fall
    assert governor.before_fall is None


def test_a_neighbour_that_stays_holds_the_fall():
    machine = _Machine(others=1)  # a neighbour spinning on one core: always runnable
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2, runnable=machine,
                               run_queue=ControlledRunQueue())
    _fall_after_a_free_box(governor)
    assert [_one_thread_forward(governor, 8) for _ in range(10)] == [1] * 10
    assert governor.summary()["threads_by_min_tokens"] == {1: 1, 8: 1, 256: 1}


def test_a_fall_soon_after_one_ended_early_is_left_to_the_probes():
    machine = _Machine(others=0)
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2, runnable=machine,
                               run_queue=ControlledRunQueue())
    _fall_after_a_free_box(governor)
    _one_thread_forward(governor, 8)
    assert governor.summary()["threads_by_min_tokens"][8] == 2
    # starved again at once: a neighbour that comes and goes; this fall does not end at a quiet moment
    drive_with_waits(governor, 8, {2: SUSTAINED_S, 1: 0.005}, {2: 0.9, 1: 0.0}, 1)
    assert [_one_thread_forward(governor, 8) for _ in range(5)] == [1] * 5
    assert governor.before_fall is None


def test_a_probe_that_moves_every_size_to_one_thread_ends_early_as_a_fall_does():
    machine = _Machine(others=1)
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2, runnable=machine,
                               run_queue=ControlledRunQueue())
    free = {2: 0.0, 1: 0.0}
    for _ in range(40):  # a free box: decode steps and a prefill size on two threads, by their own probes
        drive_with_waits(governor, 8, {2: 0.004, 1: 0.005}, free, 1)
        drive_with_waits(governor, 300, {2: 0.040, 1: 0.070}, free, 1)
    assert governor.summary()["threads_by_min_tokens"] == {8: 2, 256: 2}
    # a moment of contention that starves no thread slows the decode size's two threads: its early probe
    # finds one thread faster, and every size follows it
    drive_with_waits(governor, 8, {2: 0.010, 1: 0.005}, free, 15)
    assert governor.summary()["threads_by_min_tokens"] == {8: 1, 256: 1}
    governor.min_probe_interval = 64  # no probe within the test from here on: only the fall and its end
    assert [_one_thread_forward(governor, 300) for _ in range(3)] == [1, 1, 1]  # something else still runs
    machine.others = 0  # the contention is over
    assert _one_thread_forward(governor, 300) == 1
    # the prefill size and sizes first seen now back on two threads; the decode size keeps its own verdict
    assert governor.summary()["threads_by_min_tokens"] == {8: 1, 256: 2}
    assert governor.choose(5000) == 2
    assert governor.before_fall is None


def test_without_a_fall_nothing_looks():
    machine = _Machine(others=0)
    governor = ThreadGovernor(max_threads=2, min_probe_interval=64, runnable=machine, run_queue=ControlledRunQueue())
    drive_with_waits(governor, 1, {2: 0.004, 1: 0.003}, {2: 0.0, 1: 0.0}, 1)
    governor.groups[1].current = 1  # a size on one thread by its own verdict, no fall
    assert _one_thread_forward(governor, 1) == 1
    assert machine.looks == 0


def test_the_runnable_count_is_read_from_the_machine():
    from sgl_lite.runtime.model_executor.cpu_host.forward_looks import others_runnable

    count = others_runnable()
    if count is None:
        pytest.skip("no /proc/loadavg here")
    spinner = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        time.sleep(0.5)
        busy = [others_runnable() for _ in range(20)]
    finally:
        spinner.kill()
        spinner.wait()
    assert min(busy) >= 1  # the spinning process is always runnable