"""Hostile and careless clients to run beside a soak's normal ones (nested messages built as the
protocol fuzzer builds them): deeply nested messages, over-long rids, a peer that never reads its replies,
over-limit stop strings, over-limit grammars and JSON schemas on the ZeroMQ wire; prompts x n over the
fan-out cap, bodies over the body limit, slowloris headers and clients that hang up before their first
event over HTTP.

One thread cycles through the cases (in a seeded random order per round) until stopped. Each case
checks the answer it must get (the error naming the limit, a 413, a closed connection) and records a
problem otherwise; what it cannot see (aborted work, freed KV, bounded memory) the soak's own checks
at the end cover: greedy outputs of the normal clients unchanged, the idle accounting invariant, RSS.
`HostileRun` also starts the HTTP front those cases talk to, in this process, over the runtime.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import zmq

from sgl_lite.http.app import create_app
from sgl_lite.http.guards.limits import HttpLimits
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import RuntimeClient, use_api_key
from sgl_lite.testing.fuzz import NESTED_FIELDS, nested_message

# The soak's limits: small, so that going past them is cheap; the runtime is started with the same
# (hostile_server_args).
HOSTILE_LIMITS = HttpLimits(max_request_body_bytes=256 * 1024, max_chat_messages=64, max_request_fanout=16)
HEADER_TIMEOUT_S = 2.0
_REPLY_WAIT_S = 60.0


def hostile_server_args(runaway_compiles: bool = False) -> dict[str, int]:
    """Runtime flags the hostile cases go past: a short send queue per client, small grammar caps (with
    `runaway_compiles`, room for hostile_load's runaway regex, which must reach the compiler)."""
    return dict(max_queued_replies_per_client=64, max_grammar_chars=32 * 1024 if runaway_compiles else 4096,
                max_json_schema_depth=16)


@dataclass
class HostileTarget:
    address: str  # the runtime's ZeroMQ endpoint
    http_host: str
    http_port: int
    api_key: str | None = None
    max_grammar_chars: int = 4096
    max_json_schema_depth: int = 16


@dataclass
class HostileReport:
    attempts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- the ZeroMQ wire


def _ask(target: HostileTarget, payload: bytes, *, read: bool = True) -> protocol.Reply | None:
    """Send one raw message from a fresh DEALER; its first reply (None without one or when not `read`)."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    use_api_key(sock, target.api_key)
    sock.connect(target.address)
    try:
        sock.send(payload)
        if read and sock.poll(int(_REPLY_WAIT_S * 1000)):
            return protocol.decode_reply(sock.recv())
        return None
    finally:
        sock.close()


def _expect_error(reply: protocol.Reply | None, *needles: str) -> str | None:
    if not isinstance(reply, protocol.ErrorReply) or reply.code != "bad_request":
        return f"expected a bad_request ErrorReply, got {reply!r}"[:300]
    missing = [n for n in needles if n not in reply.message]
    return f"the error does not name {missing}: {reply.message[:200]}" if missing else None


def _generate(target: HostileTarget, rid: str = "", **params: object) -> bytes:
    return protocol.encode(protocol.GenerateReq(rid or uuid.uuid4().hex, text="The quick brown fox",
                                                sampling_params=protocol.SamplingParams(max_new_tokens=4, **params)))


def nested(target: HostileTarget, rng: random.Random) -> str | None:
    payload = nested_message(rng.choice(NESTED_FIELDS), rng.randint(1000, 5000), rng.choice(["array", "map"]))
    reply = _ask(target, payload)
    return None if isinstance(reply, protocol.ErrorReply) and reply.code == "bad_request" else f"got {reply!r}"[:300]


def long_rid(target: HostileTarget, rng: random.Random) -> str | None:
    rid = "r" * rng.randint(protocol.MAX_RID_CHARS + 1, 1_000_000)
    payload = msgspec.msgpack.encode({"type": "HealthReq", "rid": rid})
    reply = _ask(target, payload)
    if isinstance(reply, protocol.ErrorReply) and reply.rid != "":
        return f"an over-long rid was echoed ({len(reply.rid)} characters)"
    return _expect_error(reply, "rid")


def non_reader(target: HostileTarget, rng: random.Random) -> str | None:
    """A long stream and a flood of info requests (a few KB of reply each), none of it read, then gone."""
    long = protocol.SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    frames = [protocol.encode(protocol.GenerateReq(uuid.uuid4().hex, text="The quick brown fox", stream=True,
                                                   sampling_params=long))]
    frames += [protocol.encode(protocol.ServerInfoReq(uuid.uuid4().hex)) for _ in range(400)]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    use_api_key(sock, target.api_key)
    sock.connect(target.address)
    try:
        for frame in frames:
            sock.send(frame)
        time.sleep(rng.uniform(0.5, 2.0))
    finally:
        sock.close()
    return None


def stop_strings(target: HostileTarget, rng: random.Random) -> str | None:
    if rng.random() < 0.5:
        stops = [f"stop{i}" for i in range(protocol.MAX_STOP_STRINGS + 1)]
    else:
        stops = ["s" * (protocol.MAX_STOP_STRING_CHARS + 1)]
    return _expect_error(_ask(target, _generate(target, stop=stops)), "stop")


def grammar(target: HostileTarget, rng: random.Random) -> str | None:
    if rng.random() < 0.5:
        regex = "(a|b)" * (target.max_grammar_chars // 5 + 1)
        return _expect_error(_ask(target, _generate(target, regex=regex)), "--max-grammar-chars")
    schema: dict = {"type": "string"}
    for _ in range(target.max_json_schema_depth + 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return _expect_error(_ask(target, _generate(target, json_schema=json.dumps(schema))), "--max-json-schema-depth")


# ---------------------------------------------------------------------------- HTTP


def _http(target: HostileTarget, head: str, body: bytes = b"", *, read: bool = True) -> str:
    """Send a raw request; the response's status line and body ('' when not `read` or closed)."""
    auth = f"Authorization: Bearer {target.api_key}\r\n" if target.api_key else ""
    with socket.create_connection((target.http_host, target.http_port), timeout=_REPLY_WAIT_S) as sock:
        sock.sendall(f"{head}\r\nHost: soak\r\n{auth}Content-Type: application/json\r\n".encode() + body)
        if not read:
            return ""
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def _post(target: HostileTarget, path: str, payload: dict, *, read: bool = True) -> str:
    body = json.dumps(payload).encode()
    return _http(target, f"POST {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {len(body)}", b"\r\n" + body, read=read)


def fanout(target: HostileTarget, rng: random.Random) -> str | None:
    n = rng.randint(2, 8)
    prompts = HOSTILE_LIMITS.max_request_fanout // n + 1
    answer = _post(target, "/v1/completions", {"prompt": ["hi"] * prompts, "n": n, "max_tokens": 1})
    ok = answer.startswith("HTTP/1.1 400") and "--max-request-fanout" in answer
    return None if ok else f"prompts x n over the cap got {answer[:200]!r}"


def big_body(target: HostileTarget, rng: random.Random) -> str | None:
    limit = HOSTILE_LIMITS.max_request_body_bytes
    if rng.random() < 0.5:  # declared: refused before the body is read
        answer = _http(target, f"POST /v1/completions HTTP/1.1\r\nContent-Length: {limit + 1}", b"\r\n{")
    else:  # chunked: refused once the count passes the limit
        piece = b"x" * 16384
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        body = b'\r\nc\r\n{"prompt": "\r\n' + chunk * (limit // len(piece) + 1)
        try:
            answer = _http(target, "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked", body)
        except (BrokenPipeError, ConnectionResetError):
            return None  # refused while we were still sending: closed, and nothing was parsed
    return None if answer.startswith("HTTP/1.1 413") else f"a body over the limit got {answer[:200]!r}"


def slowloris(target: HostileTarget, rng: random.Random) -> str | None:
    """Header lines trickled for ever: the front must close the connection after its header timeout."""
    started = time.monotonic()
    with socket.create_connection((target.http_host, target.http_port), timeout=0.5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\n")
        while time.monotonic() - started < HEADER_TIMEOUT_S + 10:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                if sock.recv(1024) == b"":
                    break
            except socket.timeout:
                continue
            except OSError:
                break
    waited = time.monotonic() - started
    return None if waited < HEADER_TIMEOUT_S + 5 else f"slow headers kept the connection {waited:.1f} s"


def hang_up_early(target: HostileTarget, rng: random.Random) -> str | None:
    """A request (streamed or not) whose client leaves before its first event: the front must abort it."""
    payload = {"prompt": "The quick brown fox", "max_tokens": 64, "ignore_eos": True, "stream": rng.random() < 0.5}
    _post(target, "/v1/completions", payload, read=False)
    return None


CASES: dict[str, Callable[[HostileTarget, random.Random], str | None]] = {
    "nested": nested, "long_rid": long_rid, "non_reader": non_reader, "stop_strings": stop_strings,
    "grammar": grammar, "fanout": fanout, "big_body": big_body, "slowloris": slowloris, "hang_up_early": hang_up_early,
}


class HostileRun:
    """The HTTP front over the runtime at `address` and the hostile thread, from `with` to the end of the
    round under way then. `pause_s` between two cases keeps the hostile load beside the normal one, not
    instead of it."""

    def __init__(self, address: str, api_key: str | None = None, seed: int = 0, pause_s: float = 0.2,
                 caps: dict[str, int] | None = None) -> None:
        self.report = HostileReport()
        self._client = RuntimeClient(address, api_key=api_key, timeout=120)
        self._http = HttpServerThread(create_app(self._client, api_key=api_key, limits=HOSTILE_LIMITS),
                                      header_timeout_s=HEADER_TIMEOUT_S)
        caps = caps or hostile_server_args()  # the runtime's flags: over-limit cases go just past them
        self.target = HostileTarget(address, self._http.host, self._http.port, api_key,
                                    caps["max_grammar_chars"], caps["max_json_schema_depth"])
        self._rng = random.Random(seed)
        self._pause_s = pause_s
        self._stop = threading.Event()
        self.rounds_done = 0  # rounds in which every case ran once
        self._thread = threading.Thread(target=self._run, name="soak-hostile", daemon=True)

    def __enter__(self) -> HostileRun:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(len(CASES) * (HEADER_TIMEOUT_S + 2 * _REPLY_WAIT_S))
        self._http.stop()
        self._client.close()

    def _run(self) -> None:
        names = list(CASES)
        while not self._stop.is_set():
            self._rng.shuffle(names)
            for name in names:  # a round, once begun, is finished: every case runs whenever one round does
                time.sleep(self._pause_s)
                self.report.attempts[name] = self.report.attempts.get(name, 0) + 1
                try:
                    problem = CASES[name](self.target, self._rng)
                except Exception as e:  # noqa: BLE001 - a case that raises is a finding, not the end of the run
                    problem = f"raised {e!r}"
                if problem:
                    self.report.problems.append(f"hostile {name}: {problem}")
            self.rounds_done += 1
