"""Grammar compile workers run at a lower CPU priority than the runtime (a higher nice value), so a
runaway compile takes the cores only when the forward pass leaves them idle; grammars still compile
and constrain there."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest

from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.compile_process import COMPILE_NICE_INCREMENT, LOWEST_PRIORITY_NICENESS, lower_cpu_priority

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="nice values per thread, read from /proc: Linux")


def thread_niceness(pid: int) -> dict[int, int]:
    """The nice value of every thread of process `pid`."""
    return {int(tid): os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def in_thread_at(niceness: int, fn):
    """`fn()` on a new thread running at `niceness` (a thread of its own: a raised nice value cannot be
    lowered again without privilege, and the test process's other threads keep theirs)."""
    result: list = []

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        result.append(fn())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def test_compile_workers_run_below_the_runtime_and_still_constrain(tiny_tokenizer, caplog):
    from sgl_lite.runtime.sampling.grammar import GrammarBackend

    own = os.getpriority(os.PRIO_PROCESS, 0)
    expected = min(own + COMPILE_NICE_INCREMENT, LOWEST_PRIORITY_NICENESS)
    backend = GrammarBackend(tiny_tokenizer, len(tiny_tokenizer), eos_token_ids=[tiny_tokenizer.eos_token_id], max_workers=1)
    try:
        with caplog.at_level(logging.INFO, logger="sgl_lite.runtime.sampling.compile_process"):
            matcher = backend.request_matcher(SamplingParams(regex="(yes|no)")).result(120)
        worker = backend._pool._runners[0].pid
        server = backend._fork_server._process.pid
        assert worker is not None and worker != server
        for pid in (server, worker):
            assert set(thread_niceness(pid).values()) == {expected}, f"process {pid}: {thread_niceness(pid)}"
        assert os.getpriority(os.PRIO_PROCESS, 0) == own, "the runtime's own priority changed"
        assert f"grammar compile workers run at nice {expected}" in caplog.text

        yes = tiny_tokenizer.encode("yes", add_special_tokens=False)
        maybe = tiny_tokenizer.encode("maybe", add_special_tokens=False)
        assert matcher.allowed_prefix(yes) == len(yes)
        assert matcher.allowed_prefix(maybe) < len(maybe)
    finally:
        backend.shutdown()


@pytest.mark.parametrize("starter_niceness", [3, 15])
def test_the_lowered_priority_is_relative_to_the_starting_thread_and_bounded(starter_niceness):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        got = in_thread_at(starter_niceness, lambda: lower_cpu_priority(child.pid))
        expected = min(starter_niceness + COMPILE_NICE_INCREMENT, LOWEST_PRIORITY_NICENESS)
        assert got == expected == os.getpriority(os.PRIO_PROCESS, child.pid)
    finally:
        child.kill()
        child.wait()


def test_a_process_that_cannot_be_reniced_is_logged_not_raised(caplog):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process any more
    with caplog.at_level(logging.WARNING, logger="sgl_lite.runtime.sampling.compile_process"):
        assert lower_cpu_priority(child.pid) is None
    assert "run at the runtime's CPU priority" in caplog.text
