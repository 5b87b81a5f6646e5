"""The thread governor picks the faster thread count per token-count group, from forward times alone
(its falls to one thread and their early ends: test_thread_governor_falls.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from governor_drives import ControlledRunQueue, drive_with_waits, restore_torch_threads  # noqa: F401 (an autouse fixture)

from sgl_lite.runtime.model_executor.cpu_host.run_queue import RunQueueWait, forward_thread_ids
from sgl_lite.runtime.model_executor.cpu_host.thread_governor import SUSTAINED_S, ThreadGovernor


def _drive(governor: ThreadGovernor, num_tokens: int, seconds_by_threads: dict[int, float], forwards: int) -> list[int]:
    """Run `forwards` forwards whose time depends only on the thread count; the counts chosen, in order."""
    chosen = []
    for _ in range(forwards):
        threads = governor.choose(num_tokens)
        assert torch.get_num_threads() == threads
        governor.record(num_tokens, threads, seconds_by_threads[threads])
        chosen.append(threads)
    return chosen


def test_switches_to_one_thread_when_it_is_faster_and_back_when_it_is_not():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, max_probe_interval=32, probe_forwards=2)
    chosen = _drive(governor, 8, {2: 0.010, 1: 0.004}, 40)  # a busy core: one thread wins
    assert chosen[0] == 2 and chosen[-20:].count(1) >= 16  # the rest are probes of 2 threads
    chosen = _drive(governor, 8, {2: 0.004, 1: 0.010}, 60)  # the core is free again
    assert chosen[-20:].count(2) >= 16


def test_keeps_the_faster_count_and_probes_within_budget():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=3, probe_budget=0.02)
    chosen = _drive(governor, 1, {2: 0.004, 1: 0.005}, 2000)
    assert governor.summary()["threads_by_min_tokens"] == {1: 2}
    lost = chosen.count(1) * 0.001  # each probe forward on one thread costs 1 ms more
    assert lost / (chosen.count(2) * 0.004 + chosen.count(1) * 0.005) < 0.03


def test_a_hopeless_probe_ends_at_once_and_is_rarely_repeated():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=3, probe_budget=0.02)
    _drive(governor, 1, {2: 0.700, 1: 0.013}, 30)  # two threads stall badly: one thread wins
    assert governor.groups[1].current == 1
    chosen = _drive(governor, 1, {2: 0.700, 1: 0.013}, 3000)
    assert chosen.count(2) <= 2  # one-forward probes, ~2,600 forwards apart (2% of the time they cost)


def test_groups_by_token_count_decide_separately():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, max_probe_interval=32, probe_forwards=2)
    chosen = []
    for _ in range(200):  # small decode steps prefer one thread, big prefills both
        _drive(governor, 1, {2: 0.010, 1: 0.004}, 1)
        chosen += _drive(governor, 512, {2: 0.050, 1: 0.090}, 1)
    assert governor.summary()["threads_by_min_tokens"] == {1: 1, 512: 2}
    assert chosen[-100:].count(2) >= 90  # and their own verdicts hold: neither drags the other along


def test_a_new_group_starts_from_the_latest_verdict():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, max_probe_interval=32, probe_forwards=2)
    _drive(governor, 8, {2: 0.010, 1: 0.004}, 20)  # decode steps found one thread faster
    assert governor.choose(300) == 1  # so the first large prefill runs on one thread too


def test_a_lasting_slowdown_triggers_a_probe_at_once_and_a_moment_of_one_does_not():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2)
    _drive(governor, 8, {2: 0.004, 1: 0.005}, 300)  # a quiet box: probes ~38 forwards apart
    assert governor.groups[4].probe_interval > 12
    # the HTTP front's burst: four slow forwards, then quiet again: no early probe, no switch
    _drive(governor, 8, {2: 0.040, 1: 0.005}, 4)
    _drive(governor, 8, {2: 0.004, 1: 0.005}, 4)
    assert governor.groups[4].current == 2
    _drive(governor, 8, {2: 0.040, 1: 0.020}, 12)  # a neighbour takes a core
    assert governor.groups[4].current == 1  # switched within a dozen forwards, not after 38


def test_a_switch_in_one_group_moves_the_others():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2)
    for _ in range(40):  # a free box: every size on two threads
        _drive(governor, 8, {2: 0.004, 1: 0.005}, 1)
        _drive(governor, 300, {2: 0.040, 1: 0.070}, 1)
    assert governor.summary()["threads_by_min_tokens"] == {8: 2, 256: 2}
    _drive(governor, 8, {2: 0.500, 1: 0.005}, 6)  # a neighbour: one catastrophic decode forward is enough
    assert governor.groups[4].current == 1
    assert governor.groups[9].current == 1  # the prefill size follows before paying for its own discovery


def test_a_hopeless_probe_postpones_the_count_everywhere():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2)
    _drive(governor, 300, {2: 0.040, 1: 0.070}, 1)  # a prefill size seen once on a free box
    _drive(governor, 8, {2: 0.900, 1: 0.020}, 15)  # a neighbour: decode moves to one thread, then a probe of two stalls
    assert governor.groups[4].current == 1 and governor.groups[9].current == 1
    chosen = _drive(governor, 300, {2: 3.000, 1: 0.200}, 40)
    assert 2 not in chosen  # the prefill size does not pay for its own stalled probe


def test_a_starved_forward_moves_every_group_to_one_thread_at_once():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2)
    free = {2: 0.05, 1: 0.0}
    for _ in range(40):  # a free box: both sizes on two threads, which hardly wait for a CPU
        drive_with_waits(governor, 8, {2: 0.004, 1: 0.005}, free, 1)
        drive_with_waits(governor, 300, {2: 0.040, 1: 0.070}, free, 1)
    assert governor.summary()["threads_by_min_tokens"] == {8: 2, 256: 2}
    # a neighbour takes a core: the very next forward's threads wait 90% of its time for a CPU
    chosen = drive_with_waits(governor, 300, {2: 0.400, 1: 0.075}, {2: 0.9, 1: 0.0}, 2)
    assert chosen == [2, 1]
    assert governor.summary()["threads_by_min_tokens"] == {8: 1, 256: 1}
    assert governor.choose(5000) == 1  # sizes not seen yet start there too


def test_a_size_starved_from_its_first_forward_falls_once_it_lasts_and_two_threads_come_back_when_free():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, max_probe_interval=32, probe_forwards=2)
    step = 0.3 * SUSTAINED_S  # four starved forwards add up to the sustained starvation
    chosen = drive_with_waits(governor, 8, {2: step, 1: 0.010}, {2: 0.9, 1: 0.1}, 6)
    assert chosen == [2, 2, 2, 2, 1, 1]  # no verdict to compare with: the wait alone decides
    chosen = drive_with_waits(governor, 8, {2: 0.004, 1: 0.008}, {2: 0.0, 1: 0.0}, 60)  # the neighbour left
    assert chosen[-20:].count(2) >= 16


def test_sizes_moved_by_a_fall_come_back_with_the_decode_sizes_verdict():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, max_probe_interval=32, probe_forwards=2)
    free = {2: 0.0, 1: 0.0}
    for _ in range(40):  # a free box: decode steps and a prefill size on two threads, a batch-1 size on one
        drive_with_waits(governor, 8, {2: 0.004, 1: 0.005}, free, 1)
        drive_with_waits(governor, 300, {2: 0.040, 1: 0.070}, free, 1)
        drive_with_waits(governor, 1, {2: 0.004, 1: 0.003}, free, 1)
    assert governor.summary()["threads_by_min_tokens"] == {1: 1, 8: 2, 256: 2}
    # contention: one decode step starved for long enough moves every size to one thread
    drive_with_waits(governor, 8, {2: SUSTAINED_S, 1: 0.005}, {2: 0.9, 1: 0.0}, 1)
    assert governor.summary()["threads_by_min_tokens"] == {1: 1, 8: 1, 256: 1}
    # the box is free again: decode steps (many per turn) find two threads faster within a few dozen
    drive_with_waits(governor, 8, {2: 0.004, 1: 0.005}, free, 40)
    assert governor.groups[4].current == 2
    # the prefill size, not seen since, follows them instead of running on one thread until its own probe
    assert governor.choose(300) == 2
    # the batch-1 size followed too (the fall erased every verdict), and its own probe takes it back to one
    chosen = drive_with_waits(governor, 1, {2: 0.004, 1: 0.003}, free, 40)
    assert chosen[-20:].count(1) >= 16


def test_a_turns_arrivals_waits_do_not_move_every_group_to_one_thread():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2)
    free = {2: 0.0, 1: 0.0}
    for _ in range(40):
        drive_with_waits(governor, 8, {2: 0.004, 1: 0.005}, free, 1)
        drive_with_waits(governor, 300, {2: 0.040, 1: 0.070}, free, 1)
    # the HTTP front tokenizing a turn's prompts: one prefill's threads wait 55% of its time, and it is slower
    chosen = drive_with_waits(governor, 300, {2: 0.090, 1: 0.075}, {2: 0.55, 1: 0.0}, 1)
    assert chosen == [2]
    assert governor.summary()["threads_by_min_tokens"] == {8: 2, 256: 2}


def test_only_starvation_that_lasts_moves_every_group_to_one_thread():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=64)  # no probe within this test
    free, starved = {2: 0.0, 1: 0.0}, {2: 0.9, 1: 0.0}
    moment = 0.75 * SUSTAINED_S
    for _ in range(10):
        drive_with_waits(governor, 8, {2: 0.004, 1: 0.005}, free, 1)
        drive_with_waits(governor, 300, {2: 0.040, 1: 0.070}, free, 1)
    # the HTTP front's burst (a turn's prompts, its clients' replies): a starved decode step and a starved
    # prefill with a free forward between them, each shorter than the sustained starvation: nothing falls
    assert drive_with_waits(governor, 8, {2: moment, 1: 0.005}, starved, 1) == [2]
    assert drive_with_waits(governor, 300, {2: 0.040, 1: 0.070}, free, 1) == [2]
    assert drive_with_waits(governor, 300, {2: moment, 1: 0.070}, starved, 1) == [2]
    assert governor.summary()["threads_by_min_tokens"] == {8: 2, 256: 2}
    # a neighbour: starved forwards in a row, of any size, add up to it: every size falls
    assert drive_with_waits(governor, 8, {2: moment, 1: 0.005}, starved, 1) == [2]
    assert governor.summary()["threads_by_min_tokens"] == {8: 1, 256: 1}


def test_a_starved_forward_that_is_as_fast_as_its_verdict_changes_nothing():
    governor = ThreadGovernor(max_threads=2, min_probe_interval=4, probe_forwards=2)
    drive_with_waits(governor, 8, {2: 0.004, 1: 0.009}, {2: 0.0, 1: 0.0}, 40)
    assert governor.groups[4].current == 2
    # the threads wait for a CPU, but the forwards are as fast as before: nothing to gain from one thread
    chosen = drive_with_waits(governor, 8, {2: 0.0042, 1: 0.009}, {2: 0.9, 1: 0.0}, 20)
    assert chosen.count(2) >= 16


def test_the_run_queue_wait_of_the_forward_threads_is_read_and_grows_under_contention():
    clock = RunQueueWait()
    if not clock.available:
        pytest.skip("no /proc/self/task/*/schedstat here")
    ids = forward_thread_ids()
    assert threading.get_native_id() in ids and all(os.path.exists(f"/proc/self/task/{tid}") for tid in ids)
    clock.watch(ids)
    first = clock.seconds()
    assert first is not None and first >= 0.0
    # more busy processes than cores, this thread among them: it must wait for a CPU now and then
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            pass
    finally:
        for hog in hogs:
            hog.kill()
    assert clock.seconds() > first
    clock.close()


def _forward_of_layers(governor: ThreadGovernor, num_tokens: int, layers: int, layer_seconds: float,
                       waiting_threads: float, run_queue: ControlledRunQueue) -> list[int]:
    """One forward of `layers` layers through governor.forward, calling its watch between them; while a layer
    runs, `waiting_threads` threads wait for a CPU. The thread count each layer ran on."""
    counts = []
    with governor.forward(num_tokens) as watch:
        for _ in range(layers):
            counts.append(torch.get_num_threads())
            time.sleep(layer_seconds)
            run_queue.total += waiting_threads * layer_seconds
            if watch is not None:
                watch()
    return counts


def test_a_forward_stalled_midway_runs_its_remaining_layers_on_one_thread():
    run_queue = ControlledRunQueue()
    governor = ThreadGovernor(max_threads=2, min_probe_interval=64, run_queue=run_queue)
    for _ in range(5):  # a prefill size timed on a free box: ~30 ms on two threads
        assert _forward_of_layers(governor, 300, 10, 0.003, 0.0, run_queue) == [2] * 10
    # a neighbour takes a core: every layer now waits (one thread of two off its core), and takes 20x as long
    counts = _forward_of_layers(governor, 300, 6, 0.6 * SUSTAINED_S, 1.0, run_queue)
    # dropped once the starvation lasted (two layers, unless the sleeps overran), not after all six stalled layers
    assert counts[0] == 2 and counts[-1] == 1 and counts.count(2) <= 3
    assert governor.summary()["threads_by_min_tokens"] == {256: 1}  # and every later forward starts on one


def test_a_forward_stalled_for_a_moment_keeps_its_threads():
    run_queue = ControlledRunQueue()
    governor = ThreadGovernor(max_threads=2, min_probe_interval=64, run_queue=run_queue)
    for _ in range(5):
        _forward_of_layers(governor, 300, 10, 0.003, 0.0, run_queue)
    # the HTTP front takes a core for a moment: a forward's layers stall, for less than the sustained starvation
    assert _forward_of_layers(governor, 300, 4, 0.18 * SUSTAINED_S, 1.0, run_queue) == [2] * 4
    assert governor.summary()["threads_by_min_tokens"] == {256: 2}


def test_a_slow_forward_whose_threads_do_not_wait_stays_on_its_threads():
    run_queue = ControlledRunQueue()
    governor = ThreadGovernor(max_threads=2, min_probe_interval=64, run_queue=run_queue)
    for _ in range(5):
        _forward_of_layers(governor, 300, 10, 0.003, 0.0, run_queue)
    # slower for another reason (a longer context, a busier memory bus): no core was taken
    assert _forward_of_layers(governor, 300, 10, 0.012, 0.1, run_queue) == [2] * 10
    assert governor.summary()["threads_by_min_tokens"] == {256: 2}
