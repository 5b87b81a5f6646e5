"""The grammar compile pool's scheduling (no xgrammar): at most `workers` jobs at once, a free worker goes
to the client with the fewest compiles running, and a job nobody waits for is cancelled or killed (its worker
process too when the kill comes while that process is still being started)."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import threading
from multiprocessing.connection import Connection

from waiting import wait_until

from sgl_lite.runtime.sampling.compile_pool import CompilePool
from sgl_lite.runtime.sampling.compile_process import CompileCancelled, CompileProcess


class BlockingRunner:
    """A worker whose job blocks until released, or until killed (as a killed worker process would end it)."""

    def __init__(self) -> None:
        self.killed = threading.Event()
        self.kills = 0

    def kill(self) -> None:
        self.kills += 1
        self.killed.set()

    def close(self) -> None:
        self.kill()


def job(name: str, started: list[str], release: dict[str, threading.Event]):
    release[name] = threading.Event()

    def run(runner: BlockingRunner) -> str:
        started.append(name)
        while not release[name].wait(0.01):
            if runner.killed.is_set():
                runner.killed.clear()
                raise RuntimeError(f"{name} killed")
        return name

    return run


def test_a_free_worker_goes_to_the_client_with_the_fewest_compiles_running() -> None:
    pool = CompilePool(2, BlockingRunner)
    started: list[str] = []
    release: dict[str, threading.Event] = {}
    try:
        a1 = pool.submit(10, job("a1", started, release), owner="A")
        a2 = pool.submit(10, job("a2", started, release), owner="A")
        wait_until(lambda: len(started) == 2, "two jobs to start", 10, poll_s=0.01)  # alone, client A may use both workers
        a3 = pool.submit(1, job("a3", started, release), owner="A")  # smaller, but A already runs two
        b1 = pool.submit(10, job("b1", started, release), owner="B")
        assert pool.running_per_owner() == {"A": 2}
        release["a1"].set()
        assert a1.result(10) == "a1"
        wait_until(lambda: len(started) == 3, "a third job to start", 10, poll_s=0.01)
        assert started[2] == "b1"  # B ran nothing: its job goes before A's third
        for name in ("a2", "b1", "a3"):
            release[name].set()
        assert [f.result(10) for f in (a2, b1, a3)] == ["a2", "b1", "a3"]
    finally:
        for event in release.values():
            event.set()
        pool.shutdown()


def test_within_one_client_the_smallest_job_goes_first_and_a_running_job_nobody_waits_for_is_killed() -> None:
    pool = CompilePool(1, BlockingRunner)
    started: list[str] = []
    release: dict[str, threading.Event] = {}
    try:
        big = pool.submit(100, job("big", started, release))
        wait_until(lambda: started == ["big"], "the big job to start", 10, poll_s=0.01)
        queued_big = pool.submit(50, job("queued", started, release))
        small = pool.submit(1, job("small", started, release))
        pool.write_off(queued_big)  # queued: cancelled, never run
        assert queued_big.cancelled()
        pool.write_off(big)  # running: its runner is killed, and the worker takes the next job
        wait_until(lambda: started == ["big", "small"], "the small job to start next", 10, poll_s=0.01)
        assert "killed" in str(big.exception(10))
        release["small"].set()
        assert small.result(10) == "small" and not pool.busy()
    finally:
        for event in release.values():
            event.set()
        pool.shutdown()


def test_the_client_of_a_request_is_its_connection_as_the_server_keys_it() -> None:
    from sgl_lite.runtime.managers.validation import client_of

    assert client_of("0a1b2c/my-rid") == "0a1b2c" and client_of("0a1b2c/a/b") == "0a1b2c"
    assert client_of("in-process-rid") == ""


class SlowForkServer:
    """A fork server whose fork waits for `go`: a worker process (a `sleep`) and its pipe, as the real one gives."""

    def __init__(self) -> None:
        self.forking, self.go = threading.Event(), threading.Event()
        self.workers: list[subprocess.Popen] = []
        self.ends: list[Connection] = []

    def fork(self) -> tuple[int, Connection]:
        self.forking.set()
        self.go.wait(10)
        worker = subprocess.Popen(["sleep", "60"])
        self.workers.append(worker)
        ours, theirs = multiprocessing.Pipe()
        self.ends.append(theirs)
        return worker.pid, ours


def test_a_kill_while_the_worker_is_still_starting_ends_that_worker() -> None:
    """write_off's kill can come while a job's worker process is still being forked (no pid yet): the compile
    is cancelled and the new worker ended as soon as it exists (once, it compiled on, for up to its CPU limit)."""
    server = SlowForkServer()
    process = CompileProcess(server)  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def compile_one() -> None:
        try:
            process.compile("regex", "a+", 60.0)
        except BaseException as e:  # noqa: BLE001 - what it raised is what the test checks
            errors.append(e)

    job = threading.Thread(target=compile_one)
    job.start()
    assert server.forking.wait(10)
    process.kill()  # no worker yet
    server.go.set()
    job.join(10)
    assert not job.is_alive() and len(errors) == 1 and isinstance(errors[0], CompileCancelled), errors
    assert server.workers[0].wait(10) == -signal.SIGKILL and process.pid is None
    server.go.clear()
    server.go.set()  # the next job starts a worker of its own, and is not cancelled by the old kill
    second = threading.Thread(target=compile_one)
    second.start()
    wait_until(lambda: len(server.workers) >= 2 and process.pid is not None, "the second worker", 10)
    process.kill()
    server.ends[1].close()  # what the killed worker's end of the pipe does as it dies
    second.join(10)
    assert len(errors) == 2 and isinstance(errors[1], CompileCancelled) and server.workers[1].wait(10) == -signal.SIGKILL
