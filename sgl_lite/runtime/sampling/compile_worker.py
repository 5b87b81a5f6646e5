"""A grammar compile where it can be killed: the worker processes' side (the runtime's side is
compile_process.py), and the conversion of a constraint to the grammar xgrammar compiles.

xgrammar's conversion of a JSON schema and its compile of a grammar cannot be interrupted, and a thread
cannot be killed, so a compile the runtime gave up on (its request was refused after
--grammar-compile-timeout, or aborted) used to run on to its end, for minutes with a pathological regex.
Each compile now runs in a worker process that the runtime kills when nobody waits for it any more,
and that also ends itself past a CPU-time limit per compile (RLIMIT_CPU), should the runtime not.

`python -m sgl_lite.runtime.sampling.compile_worker RUNTIME_PID` is a fork server: it imports xgrammar
(which imports torch: seconds) and builds the model's TokenizerInfo and a single-threaded compiler once,
then forks a worker per request of the runtime, handing it a socket the runtime made; a replacement for a
killed worker thus starts in milliseconds, sharing the server's memory. (multiprocessing's own fork server
re-imports the parent's __main__ in every child, which would re-run a user's script.) A compiled grammar
crosses back as xgrammar's serialization (`CompiledGrammar.serialize_json`, without the tokenizer info)
that the runtime rebuilds against its own TokenizerInfo (`deserialize_json`); messages are length-framed
msgspec msgpack, never pickle. The server exits when the runtime closes its control socket, a worker
when the runtime's socket to it closes or when the runtime or the server is gone.

JSON schemas compile without free whitespace, and with strings free of raw control characters, which
xgrammar 0.2.8 lets into strings that carry a minLength/maxLength (invalid JSON by RFC 8259);
tests/test_grammar.py checks both.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Union

import msgspec
import xgrammar

PARENT_POLL_S = 0.5

# The character class xgrammar uses for length-bounded JSON strings, and the RFC 8259 one.
_LENIENT_JSON_STRING_CHAR = r'[^\"\\\r\n]'
_STRICT_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_ebnf(schema_text: str) -> str:
    """The EBNF of a JSON schema (compact separators), with strings free of raw control characters."""
    ebnf = str(xgrammar.Grammar.from_json_schema(schema_text, any_whitespace=False))
    return ebnf.replace(_LENIENT_JSON_STRING_CHAR, _STRICT_JSON_STRING_CHAR)


def structural_tag_ebnf(tag_text: str) -> str:
    """The EBNF of an xgrammar structural tag, its JSON parts' strings free of raw control characters."""
    ebnf = str(xgrammar.Grammar.from_structural_tag(tag_text))
    return ebnf.replace(_LENIENT_JSON_STRING_CHAR, _STRICT_JSON_STRING_CHAR)


def ebnf_of(kind: str, text: str) -> str | None:
    """The EBNF we compile for a JSON-based constraint (None for regex, which compiles directly)."""
    if kind == "json_schema":
        return json_schema_ebnf(text)
    if kind == "structural_tag":
        return structural_tag_ebnf(text)
    return text if kind == "ebnf" else None


def compile_spec(compiler: xgrammar.GrammarCompiler, kind: str, text: str) -> xgrammar.CompiledGrammar:
    """Convert and compile one constraint; ValueError("invalid <kind>: ...") when it does not."""
    try:
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(ebnf_of(kind, text))
    except (RuntimeError, ValueError, TypeError, xgrammar.InvalidStructuralTagError, xgrammar.InvalidJSONError) as e:
        raise ValueError(f"invalid {kind}: {first_line(e)}") from None


# xgrammar messages look like "[18:28:53] /project/cpp/regex_converter.cc:83: Check failed: (x) is false: <message>".
_XGRAMMAR_ERROR_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?(\S+\.(cc|h):\d+:\s*)?(Check failed: .*? is false:\s*)?")

# xgrammar echoes the whole input in some messages; an error reply needs only the start of it.
_MAX_ERROR_CHARS = 300


def first_line(error: BaseException) -> str:
    """The human part of an xgrammar error: its first line without the C++ location prefix."""
    lines = str(error).strip().splitlines()
    text = _XGRAMMAR_ERROR_PREFIX.sub("", lines[0]) if lines else ""
    text = text or type(error).__name__
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


# ---------------------------------------------------------------- the messages between runtime and worker


class CompileJob(msgspec.Struct, forbid_unknown_fields=True):
    kind: str  # "regex" | "json_schema" | "ebnf" | "structural_tag"
    text: str
    cpu_seconds: float  # the worker stops itself past this much CPU time on this job


class CompileReply(msgspec.Struct, forbid_unknown_fields=True):
    compiled: Union[str, None] = None  # CompiledGrammar.serialize_json()
    error: Union[str, None] = None  # the spec's own fault, naming its kind


_job_encoder, _job_decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CompileJob)
_reply_encoder, _reply_decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CompileReply)


# ---------------------------------------------------------------- the fork server and its workers

FORK = b"F"


def _serve_worker(conn: Connection, compiler: xgrammar.GrammarCompiler, watched: tuple[int, int]) -> None:
    """A forked worker's main loop: one compile per job, until its socket closes or the runtime is gone."""
    fork_server, runtime_pid = watched

    def exit_with_runtime() -> None:
        # A compile does not read the socket, so this thread is what notices (xgrammar releases the GIL
        # while it compiles).
        while os.getppid() == fork_server and _alive(runtime_pid):
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=exit_with_runtime, name="compile-worker-parent-watch", daemon=True).start()
    while True:
        try:
            job = _job_decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        _limit_cpu_time(job.cpu_seconds)
        try:
            reply = CompileReply(compiled=compile_spec(compiler, job.kind, job.text).serialize_json())
        except ValueError as e:
            reply = CompileReply(error=str(e))
        conn.send_bytes(_reply_encoder.encode(reply))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _limit_cpu_time(seconds: float) -> None:
    """SIGXCPU (which ends the process) once this job has used `seconds` of CPU time (soft limit only:
    an unprivileged process could never raise a lowered hard limit again for the next job)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    limit = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (limit, hard))


def fork_server(control: socket.socket, runtime_pid: int) -> None:
    """The fork server's loop on its control socket: the TokenizerInfo first, then one worker per FORK
    (with the worker's socket attached), answered with the worker's pid; returns when the socket closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU (a worker's CPU limit) dumps core by default
    channel = Connection(os.dup(control.fileno()))
    info = xgrammar.TokenizerInfo.deserialize_json(channel.recv_bytes().decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the runtime caches
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return
        if not fds:
            return  # the runtime closed the control socket
        pid = os.fork()
        if pid == 0:
            try:
                control.close()
                channel.close()
                _serve_worker(Connection(fds[0]), compiler, (os.getppid(), runtime_pid))
            finally:
                os._exit(1)  # a worker never returns into the server's loop
        os.close(fds[0])
        channel.send_bytes(pid.to_bytes(8, "little"))


if __name__ == "__main__":
    fork_server(socket.socket(fileno=int(sys.argv[2])), int(sys.argv[1]))
    os._exit(0)  # nothing to tear down (the interpreter's own teardown of torch takes seconds)
