"""The runtime's side of grammar compile workers (compile_worker.py): the fork server, started once per
grammar backend, and the handle on one worker process that the compile pool's threads run jobs on.

A worker is started by the first `compile` after its handle is made or killed, so a killed compile costs
a fork (the fork server has xgrammar loaded and the tokenizer's info built), not a new interpreter.

The fork server, and so every worker it forks, runs at a lower CPU priority than the runtime (a higher
nice value): on a loaded box the forward pass gets the cores first and a compile what is left, so a
runaway compile slows other users' requests less. A compile's CPU-time limit is unchanged; its wall-clock
timeout (--grammar-compile-timeout) is shared with a forward pass that now comes first.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from sgl_lite.runtime.sampling.compile_worker import FORK, CompileJob, CompileReply

_job_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(CompileReply)

logger = logging.getLogger(__name__)

# How many nice levels below the runtime the compile workers run, and the lowest priority Linux has.
COMPILE_NICE_INCREMENT = 10
LOWEST_PRIORITY_NICENESS = 19


def lower_cpu_priority(pid: int) -> int | None:
    """Give process `pid` the calling thread's niceness plus COMPILE_NICE_INCREMENT, at most 19.

    Linux keeps a nice value per thread: this sets the process's main thread, whose value the processes
    it forks later inherit (the fork server forks its workers there). Raising a nice value needs no
    privilege. Returns the niceness set, or None where the OS refused (the compile then runs at the
    runtime's priority, as it did before).
    """
    own = os.getpriority(os.PRIO_PROCESS, 0)
    niceness = min(own + COMPILE_NICE_INCREMENT, LOWEST_PRIORITY_NICENESS)
    try:
        os.setpriority(os.PRIO_PROCESS, pid, niceness)
    except OSError as e:
        logger.warning("grammar compile workers run at the runtime's CPU priority: setting nice %d failed (%s)", niceness, e)
        return None
    logger.info("grammar compile workers run at nice %d (the runtime's thread at %d)", niceness, own)
    return niceness


class CompileCancelled(Exception):
    """The compile was killed because nobody waits for it any more."""


class ForkServer:
    """`python -m sgl_lite.runtime.sampling.compile_worker`, started on the first `fork`."""

    def __init__(self, tokenizer_info_json: Callable[[], str]) -> None:
        self._tokenizer_info_json = tokenizer_info_json
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._channel: Connection | None = None

    def fork(self) -> tuple[int, Connection]:
        """A new worker: its pid and our end of its socket."""
        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                control, channel = self._started()
                socket.send_fds(control, [FORK], [theirs.fileno()])
                pid = int.from_bytes(channel.recv_bytes(), "little")
        except (OSError, EOFError) as e:
            ours.close()
            self.close()  # a dead server is restarted by the next fork
            raise RuntimeError(f"the grammar compile fork server failed: {e}") from None
        finally:
            theirs.close()
        return pid, Connection(ours.detach())

    def close(self) -> None:
        """Stop the server at once (its idle workers see it go and exit; the pool kills the busy ones).

        SIGKILL first, without the lock: a `fork` may hold it while the server is still starting (it
        imports xgrammar for seconds); the kill ends that wait too."""
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        with self._lock:
            if self._control is not None:
                self._control.close()
                assert self._channel is not None
                self._channel.close()
                self._control = self._channel = None
            if self._process is not None:
                self._process.wait()
                self._process = None

    def _started(self) -> tuple[socket.socket, Connection]:
        if self._process is not None and self._process.poll() is not None:
            self._control = self._channel = self._process = None
        if self._control is None:
            ours, theirs = socket.socketpair()
            self._process = subprocess.Popen(
                [sys.executable, "-m", "sgl_lite.runtime.sampling.compile_worker", str(os.getpid()), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
            theirs.close()
            lower_cpu_priority(self._process.pid)  # at once: its import of xgrammar takes seconds of CPU, then it forks
            self._control, self._channel = ours, Connection(os.dup(ours.fileno()))
            self._channel.send_bytes(self._tokenizer_info_json().encode())
        assert self._channel is not None
        return self._control, self._channel


class CompileProcess:
    """One worker process of `server`, started by the first `compile` after construction or after `kill`."""

    def __init__(self, server: ForkServer) -> None:
        self._server = server
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._conn: Connection | None = None
        self._killed = False
        self._kill_pending = False  # `kill` came while the compile under way was still starting its worker
        self._closed = False
        self.starts = 0  # how many worker processes this handle started

    @property
    def pid(self) -> int | None:
        """The worker's pid while one runs for this handle."""
        with self._lock:
            return self._pid

    def compile(self, kind: str, text: str, cpu_seconds: float) -> str:
        """The serialized CompiledGrammar of one spec, compiled in the worker (one job at a time).

        ValueError: the spec's fault (or its worker ended on it: more than `cpu_seconds` of CPU time);
        CompileCancelled: `kill`; RuntimeError: the fork server failed.
        """
        conn = self._started()
        try:
            conn.send_bytes(_job_encoder.encode(CompileJob(kind, text, cpu_seconds)))
            reply = _reply_decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            with self._lock:
                killed = self._killed
                self._forget()
            if killed:
                raise CompileCancelled("the grammar compile was cancelled") from None
            # Its worker ended on its own: past the CPU-time limit (SIGXCPU), or crashed on this spec.
            raise ValueError(f"the grammar compile's worker ended: more than {cpu_seconds:g} s of CPU time, "
                             "or a crash on this spec; simplify it (fewer alternatives, less nesting)") from None
        finally:
            with self._lock:
                self._kill_pending = False  # a kill that came once this job's worker was gone: not the next job's
        if reply.error is not None:
            raise ValueError(reply.error)
        assert reply.compiled is not None
        return reply.compiled

    def kill(self) -> None:
        """End the worker now (its compile with it); the next `compile` starts a new one. While the compile under
        way is still starting its worker, that worker is ended as soon as it exists."""
        with self._lock:
            if self._pid is None and self._conn is None:
                self._kill_pending = True
            if self._pid is not None and not self._killed:
                self._killed = True
                try:
                    os.kill(self._pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.kill()
        with self._lock:
            self._forget()

    def _started(self) -> Connection:
        with self._lock:
            if self._closed:
                raise CompileCancelled("the grammar compile workers are shut down")
            if self._conn is not None:
                return self._conn
        # Not under the lock: the fork waits for the fork server's start (seconds), and kill/close must not.
        pid, conn = self._server.fork()
        with self._lock:
            self._pid, self._conn, self._killed = pid, conn, False
            self.starts += 1
            closed, cancelled, self._kill_pending = self._closed, self._kill_pending, False
        if closed:
            self.close()
            raise CompileCancelled("the grammar compile workers are shut down")
        if cancelled:
            self.kill()
            with self._lock:
                self._forget()
            raise CompileCancelled("the grammar compile was cancelled")
        return conn

    def _forget(self) -> None:
        """Drop a dead (or killed) worker: close our end of its socket (the fork server reaps it)."""
        if self._conn is not None:
            self._conn.close()
        self._conn, self._pid = None, None
