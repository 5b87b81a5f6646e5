"""Daemon worker threads for grammar compiles, smallest job first, with cancellation and write-off.

Why not a ThreadPoolExecutor: its workers are joined at interpreter exit (a SIGTERMed server would
wait for a long compile), its queue is first-in first-out (a trivial regex would wait behind a huge
schema), and a job that runs too long holds its worker for good. Here:
- workers are daemon threads, so the process exits at once whatever they are compiling;
- the queue is ordered by job size (the spec's length), so small specs overtake big ones;
- a queued job whose Future is cancelled is never run;
- a running job that the caller gave up on (its time budget passed) can be written off: a
  replacement worker starts, so the pool keeps its width, and the written-off thread ends when its
  compile does (xgrammar cannot be interrupted). At most MAX_WRITTEN_OFF threads are written off
  at a time; past that the pool runs narrower until they finish, so threads stay bounded.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

MAX_WRITTEN_OFF = 4


class CompilePool:
    def __init__(self, workers: int, name: str = "grammar") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, concurrent.futures.Future[Any], Callable[[], Any]]] = []
        self._order = itertools.count()
        self._running: dict[concurrent.futures.Future[Any], threading.Thread] = {}
        self._written_off: set[threading.Thread] = set()
        self._stopped = False
        for _ in range(workers):
            self._start_worker()

    def submit(self, size: int, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the compile pool is shut down")
            heapq.heappush(self._queue, (size, next(self._order), future, fn))
            self._cond.notify()
        return future

    def write_off(self, future: concurrent.futures.Future[Any]) -> None:
        """Nobody waits for `future` any more: cancel it if queued; if running, replace its worker."""
        if future.cancel():
            return
        with self._cond:
            thread = self._running.get(future)
            if thread is None or thread in self._written_off or len(self._written_off) >= MAX_WRITTEN_OFF:
                return
            self._written_off.add(thread)
        logger.warning("a grammar compile ran past its time budget; starting a replacement worker")
        self._start_worker()

    def busy(self) -> bool:
        """Whether a compile is running (written-off ones included)."""
        with self._cond:
            return bool(self._running)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            queued, self._queue = self._queue, []
            self._cond.notify_all()
        for _, _, future, _ in queued:
            future.cancel()

    def _start_worker(self) -> None:
        threading.Thread(target=self._work, name=f"{self._name}-compile", daemon=True).start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                _, _, future, fn = heapq.heappop(self._queue)
                if not future.set_running_or_notify_cancel():
                    continue  # cancelled while queued
                self._running[future] = me
            try:
                future.set_result(fn())
            except BaseException as e:  # delivered to whoever waits; the worker lives on
                future.set_exception(e)
            with self._cond:
                del self._running[future]
                if me in self._written_off:
                    self._written_off.discard(me)
                    return  # its replacement took its place
