"""Grammar compiles on a fixed set of workers, smallest job first, fair between clients, with
cancellation and kill.

Why not a ThreadPoolExecutor: its workers are joined at interpreter exit (a SIGTERMed server would
wait for a long compile), its queue is first-in first-out (a trivial regex would wait behind a huge
schema), and a job that runs too long holds its worker for good. Here:
- each worker is a daemon thread that owns a runner (`make_runner()`: a compile worker process,
  compile_worker.py) and runs its jobs as `fn(runner)`, so at most `workers` compiles run at once
  and the process exits at once whatever they are compiling;
- the queue is ordered by job size (the spec's length), so small specs overtake big ones, and by
  owner (the client that asked): a free worker takes the smallest job of the owner with the fewest
  compiles running, so a client runs a second compile only while no other client's job waits, and
  another client's job waits at most until one of its running compiles ends (at the latest when its
  request runs out of --grammar-compile-timeout and the compile is killed);
- a queued job whose Future is cancelled is never run;
- a running job that nobody waits for any more is killed (`write_off`: the runner's `kill()`, which
  ends its process); the worker thread lives on and its runner starts a new process for its next job.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol


class Runner(Protocol):
    def kill(self) -> None: ...

    def close(self) -> None: ...


logger = logging.getLogger(__name__)

_Job = tuple[int, int, concurrent.futures.Future[Any], Callable[[Any], Any]]


class CompilePool:
    def __init__(self, workers: int, make_runner: Callable[[], Runner], name: str = "grammar") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queues: dict[str, list[_Job]] = {}  # owner -> its jobs, a heap by (size, arrival)
        self._order = itertools.count()
        self._running: dict[concurrent.futures.Future[Any], tuple[str, Runner]] = {}
        self._running_per_owner: Counter[str] = Counter()
        self._runners: list[Runner] = []
        self._stopped = False
        for _ in range(workers):
            runner = make_runner()
            self._runners.append(runner)
            threading.Thread(target=self._work, args=(runner,), name=f"{name}-compile", daemon=True).start()

    def submit(self, size: int, fn: Callable[[Any], Any], owner: str = "") -> concurrent.futures.Future[Any]:
        """Queue `fn(runner)`, `size` its cost estimate, `owner` the client it is compiled for."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the compile pool is shut down")
            heapq.heappush(self._queues.setdefault(owner, []), (size, next(self._order), future, fn))
            self._cond.notify()
        return future

    def write_off(self, future: concurrent.futures.Future[Any]) -> None:
        """Nobody waits for `future` any more: cancel it if queued; if running, kill its runner's compile."""
        if future.cancel():
            return
        with self._cond:
            running = self._running.get(future)
        if running is not None:
            logger.warning("killing a grammar compile nobody waits for any more")
            running[1].kill()

    def busy(self) -> bool:
        """Whether a compile is running."""
        with self._cond:
            return bool(self._running)

    def running_per_owner(self) -> dict[str, int]:
        with self._cond:
            return {owner: n for owner, n in self._running_per_owner.items() if n}

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            queued = [job for jobs in self._queues.values() for job in jobs]
            self._queues.clear()
            self._cond.notify_all()
        for _, _, future, _ in queued:
            future.cancel()
        for runner in self._runners:
            runner.close()

    def _next_job(self) -> tuple[str, _Job] | None:
        """The smallest job of an owner with the fewest compiles running (under the lock)."""
        best: tuple[tuple[int, int, int], str] | None = None
        for owner, jobs in self._queues.items():
            size, order = jobs[0][0], jobs[0][1]
            key = (self._running_per_owner[owner], size, order)
            if best is None or key < best[0]:
                best = (key, owner)
        if best is None:
            return None
        owner = best[1]
        job = heapq.heappop(self._queues[owner])
        if not self._queues[owner]:
            del self._queues[owner]
        return owner, job

    def _work(self, runner: Runner) -> None:
        while True:
            with self._cond:
                while not self._queues and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                taken = self._next_job()
                if taken is None:
                    continue
                owner, (_, _, future, fn) = taken
                if not future.set_running_or_notify_cancel():
                    continue  # cancelled while queued
                self._running[future] = (owner, runner)
                self._running_per_owner[owner] += 1
            try:
                future.set_result(fn(runner))
            except BaseException as e:  # delivered to whoever waits; the worker lives on
                future.set_exception(e)
            with self._cond:
                del self._running[future]
                self._running_per_owner[owner] -= 1
                if not self._running_per_owner[owner]:
                    del self._running_per_owner[owner]
