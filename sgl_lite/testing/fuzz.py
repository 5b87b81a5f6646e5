"""Property-based fuzzing of the wire protocol and of request validation (hypothesis strategies + a driver).

`payloads()` generates what a hostile or buggy peer could send: random bytes, random msgpack values,
values nested thousands deep, and near-valid requests (right tags, wrong types, out-of-range and edge values, unknown fields, bad
grammars). `FuzzSession` sends them as raw frames over a DEALER socket to a running server, syncs
after each one with a health probe, and every few messages checks that a valid greedy request from
another socket still gets exactly the unloaded answer. Used by tests/test_reliability_fuzz.py
(hundreds of examples) and scripts/fuzz_protocol.py (tens of thousands).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from hypothesis import strategies as st

from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import use_api_key

REQUEST_TAGS = ("GenerateReq", "AbortReq", "FlushCacheReq", "ServerInfoReq", "HealthReq", "UnpinSessionReq")
EDGE_INTS = (0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 10**9)
# Replies that mean validation let through something that then broke the runtime.
INTERNAL_MARKERS = ("forward pass failed", "internal error")

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
small_ints = st.integers(min_value=-3, max_value=24) | st.sampled_from(EDGE_INTS)
any_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, -0.5])


def _weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """Pick a strategy with the given weights (st.one_of does not weight its branches)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(range(len(table))).flatmap(lambda i: table[i])


def _maybe_wrong(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly the field's own kind of value, sometimes anything at all."""
    return _weighted((9, strategy), (1, msgpack_values))


SAMPLING_FIELDS: dict[str, st.SearchStrategy] = {
    "max_new_tokens": small_ints,
    "min_new_tokens": small_ints,
    "temperature": any_floats,
    "top_p": any_floats,
    "top_k": small_ints | st.integers(min_value=-5, max_value=1000),
    "min_p": any_floats,
    "frequency_penalty": any_floats,
    "presence_penalty": any_floats,
    "repetition_penalty": any_floats,
    "stop": st.none() | st.text(max_size=6) | st.lists(st.text(max_size=6), max_size=3),
    "stop_token_ids": st.none() | st.lists(small_ints | st.integers(min_value=-2, max_value=500), max_size=4),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "seed": st.none() | small_ints,
    "regex": st.none() | st.sampled_from(["[0-9]{1,3}", "(", "a|b", "x*", ""]),
    "json_schema": st.none() | st.sampled_from(['{"type": "integer"}', "not json", '{"type": "nope"}']),
    "ebnf": st.none() | st.sampled_from(['root ::= "yes" | "no"', "root ::=", "garbage"]),
}


def sampling_params(wild: bool) -> st.SearchStrategy:
    """Dicts of sampling params: well-typed values (edge cases included), or with `wild` any value anywhere."""
    optional = {k: _maybe_wrong(v) if wild else v for k, v in SAMPLING_FIELDS.items()}
    base = st.fixed_dictionaries({}, optional=optional)
    if not wild:
        return base
    return _weighted((4, base), (1, st.builds(lambda d, k, v: {**d, k: v}, base, st.text(max_size=8), msgpack_values)))


def _request(tag: str, fields: dict[str, st.SearchStrategy], wild_fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Well-typed requests (most of them), and wild ones: wrong types, a lost rid, an unknown field."""
    typed = st.fixed_dictionaries({"type": st.just(tag), "rid": st.text(min_size=1, max_size=12)}, optional=fields)
    wild = st.fixed_dictionaries({"type": st.just(tag), "rid": _maybe_wrong(st.text(max_size=12))},
                                 optional={k: _maybe_wrong(v) for k, v in wild_fields.items()})
    return _weighted((6, typed), (2, wild), (1, wild.map(lambda d: {k: v for k, v in d.items() if k != "rid"})),
                     (1, st.builds(lambda d, k, v: {**d, k: v}, wild, st.text(max_size=8), msgpack_values)))


def plausible_generate() -> st.SearchStrategy:
    """GenerateReqs with values in or near the valid ranges, so that many pass validation and run."""
    floats = lambda lo, hi: st.floats(min_value=lo, max_value=hi)  # noqa: E731
    params = st.fixed_dictionaries({"max_new_tokens": st.integers(0, 12)}, optional={
        "min_new_tokens": st.integers(0, 3), "temperature": floats(0.0, 2.0), "top_p": floats(0.05, 1.0),
        "top_k": st.integers(-1, 60), "min_p": floats(0.0, 1.0), "frequency_penalty": floats(-2.0, 2.0),
        "presence_penalty": floats(-2.0, 2.0), "repetition_penalty": floats(1e-6, 2.0),
        "stop": st.none() | st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "stop_token_ids": st.lists(st.integers(0, 383), max_size=3), "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(), "no_stop_trim": st.booleans(), "seed": st.none() | st.integers(-(2**63), 2**63 - 1),
        "regex": st.sampled_from(["[0-9]{1,3}", "(yes|no)"]),
    })
    prompt = _weighted((1, st.fixed_dictionaries({"text": st.text(min_size=1, max_size=40)})),
                       (1, st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 383), min_size=1, max_size=30)})))
    rest = st.fixed_dictionaries({"type": st.just("GenerateReq"), "rid": st.text(min_size=1, max_size=8),
                                  "sampling_params": params},
                                 optional={"stream": st.booleans(), "return_logprob": st.booleans(),
                                           "logprob_start_len": st.integers(-1, 5), "top_logprobs_num": st.integers(0, 5),
                                           "priority": st.none() | st.integers(-(2**63) + 1, 2**63 - 1)})
    return st.builds(lambda a, b: {**a, **b}, prompt, rest)


def request_dicts() -> st.SearchStrategy:
    generate_fields = {
        "text": st.none() | st.text(max_size=60),
        "input_ids": st.none() | st.lists(st.integers(min_value=-3, max_value=420) | st.sampled_from(EDGE_INTS), max_size=40),
        "stream": st.booleans(),
        "return_logprob": st.booleans(),
        "logprob_start_len": small_ints,
        "top_logprobs_num": small_ints,
        "priority": st.none() | small_ints,
        "session_pin": st.none() | st.fixed_dictionaries({"id": st.text(max_size=8), "idle_timeout_s": any_floats}),
    }
    generate = _request("GenerateReq", {**generate_fields, "sampling_params": sampling_params(wild=False)},
                        {**generate_fields, "sampling_params": sampling_params(wild=True)})
    other_fields = {tag: {"session_id": st.text(max_size=8)} if tag == "UnpinSessionReq" else {} for tag in REQUEST_TAGS[1:]}
    others = st.one_of(*(_request(tag, fields, fields) for tag, fields in other_fields.items()))
    unknown = st.fixed_dictionaries({"type": st.text(max_size=12), "rid": st.text(max_size=8)})
    return _weighted((4, generate), (3, plausible_generate()), (2, others), (1, unknown))


NESTED_FIELDS = ("type", "rid", "sampling_params", "json_schema", "input_ids", "unknown")


def nested_value(depth: int, kind: str = "array") -> bytes:
    """msgpack bytes of a value nested `depth` deep (arrays, or maps keyed "a"), built by hand: the
    encoder itself cannot nest that deep."""
    opener = b"\x91" if kind == "array" else b"\x81\xa1a"
    return opener * depth + (b"\x90" if kind == "array" else b"\x80")


def nested_message(field: str, depth: int, kind: str = "array") -> bytes:
    """A small request whose `field` holds a value nested `depth` deep (~1 KB at 1000 deep once made
    msgspec raise RecursionError, which ended the server loop)."""
    encode = msgspec.msgpack.encode
    fields: dict[str, bytes] = {"type": encode("GenerateReq"), "rid": encode("nested"), "text": encode("hi")}
    if field == "json_schema":  # a field of any type: decoded in full, however deep
        fields["sampling_params"] = b"\x81" + encode("json_schema") + nested_value(depth, kind)
    else:
        fields[field] = nested_value(depth, kind)
    body = b"".join(encode(k) + v for k, v in fields.items())
    return bytes([0x80 | len(fields)]) + body


def nested_payloads() -> st.SearchStrategy[bytes]:
    return st.builds(nested_message, st.sampled_from(NESTED_FIELDS), st.integers(100, 5000),
                     st.sampled_from(["array", "map"]))


def payloads() -> st.SearchStrategy[bytes]:
    """One message body: mostly near-valid requests, also random msgpack, random bytes and deep nesting."""
    encode = msgspec.msgpack.encode
    return _weighted((7, request_dicts().map(encode)), (2, msgpack_values.map(encode)), (1, st.binary(max_size=64)),
                     (1, nested_payloads()))


def frame_lists() -> st.SearchStrategy[list[bytes]]:
    """The frames of one DEALER send: mostly one message, sometimes several frames (refused)."""
    return _weighted((9, payloads().map(lambda p: [p])), (1, st.lists(payloads(), min_size=2, max_size=3)))


def run_fuzzed_request(core: Any, fields: dict) -> str:
    """Send one fuzzed message through decoding, validation and the scheduler of `core` (a RuntimeCore).

    Returns "not_generate" (undecodable or another message type), "refused" (validation said no, with a
    message, and nothing was queued) or "ran". Anything validation lets through must run to a normal end:
    no failed forward, no grammar rejecting a token the sampler picked despite the mask; the accounting
    invariant holds afterwards.
    """
    from sgl_lite.runtime.managers.request import FinishKind

    try:
        msg = protocol.decode_request(msgspec.msgpack.encode(fields))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return "not_generate"
    if not isinstance(msg, protocol.GenerateReq):
        return "not_generate"
    try:
        req = core.make_req("fuzz", msg.text, msg.input_ids, msg.sampling_params, return_logprob=msg.return_logprob,
                            logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                            priority=msg.priority, stream=msg.stream, session_pin=msg.session_pin)
        core.submit(req)
    except ValueError as e:
        assert str(e), "a refusal must say why"
        assert not core.has_work(), "a refused request must not be queued"
        return "refused"
    while core.has_work():
        core.step()
    reason = req.finished_reason
    assert reason is not None
    if reason.kind is FinishKind.ABORT and reason.error_code == "bad_request":
        assert reason.message, "a refusal must say why"
        return "refused"  # a JSON schema is converted with its compile, so it is refused after queueing
    assert reason.kind is not FinishKind.ABORT, reason
    core.output_text(req)
    core.meta_info(req)
    core.check_invariant()
    return "ran"


@dataclass
class FuzzStats:
    messages: int = 0
    replies: int = 0
    errors: int = 0
    valid_checks: int = 0
    lost_probes: int = 0
    problems: list[str] = field(default_factory=list)


class FuzzSession:
    """Raw DEALER sockets to a server: one for the fuzz (plus its sync probes), one for valid traffic."""

    def __init__(self, address: str, valid_prompt: str, valid_params: dict[str, Any], expected_ids: list[int],
                 api_key: str | None = None, valid_every: int = 10, timeout: float = 60.0) -> None:
        self.address, self.api_key, self.timeout = address, api_key, timeout
        self.valid_prompt, self.valid_params, self.expected_ids = valid_prompt, valid_params, expected_ids
        self.valid_every = valid_every
        self.context = zmq.Context()
        self.fuzz = self._socket()
        self.valid = self._socket()
        self.stats = FuzzStats()

    def _socket(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        sock.setsockopt(zmq.LINGER, 0)
        use_api_key(sock, self.api_key)
        sock.connect(self.address)
        return sock

    def close(self) -> None:
        self.fuzz.close()
        self.valid.close()
        self.context.term()

    def send(self, frames: list[bytes]) -> None:
        """Send one fuzz message, wait until the server has handled it, check every reply so far."""
        self.fuzz.send_multipart(frames)
        self.stats.messages += 1
        self._sync()
        if self.stats.messages % self.valid_every == 0:
            self.check_valid()

    def _sync(self) -> None:
        # The server handles one peer's messages in order: once the probe is answered, so is the fuzz.
        for _ in range(3):
            probe = f"probe-{uuid.uuid4().hex}"
            self.fuzz.send(protocol.encode(protocol.HealthReq(probe)))
            if self._drain_until(self.fuzz, probe, 10.0) is not None:
                return
            self.stats.lost_probes += 1  # a message over twice the size limit drops the connection
        raise AssertionError("the server stopped answering health probes")

    def _drain_until(self, sock: zmq.Socket, rid: str, timeout: float) -> protocol.Reply | None:
        deadline = time.monotonic() + timeout
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            data = sock.recv()
            try:
                reply = protocol.decode_reply(data)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                self.stats.problems.append(f"undecodable reply {data[:80]!r}: {e}")
                continue
            self._check_reply(reply)
            if reply.rid == rid and not isinstance(reply, protocol.TokenChunk):
                return reply
        return None

    def _check_reply(self, reply: protocol.Reply) -> None:
        if isinstance(reply, protocol.InfoReply) and reply.rid == "":
            return  # keepalive
        self.stats.replies += 1
        if isinstance(reply, protocol.ErrorReply):
            self.stats.errors += 1
            if not reply.message.strip():
                self.stats.problems.append(f"an error reply without a message: {reply}")
            if reply.code == "internal" or any(m in reply.message for m in INTERNAL_MARKERS):
                self.stats.problems.append(f"validation let through a request that broke the runtime: {reply}")

    def check_valid(self) -> None:
        rid = f"valid-{uuid.uuid4().hex}"
        msg = protocol.GenerateReq(rid, text=self.valid_prompt, sampling_params=protocol.SamplingParams(**self.valid_params))
        self.valid.send(protocol.encode(msg))
        reply = self._drain_until(self.valid, rid, self.timeout)
        self.stats.valid_checks += 1
        if not isinstance(reply, protocol.Finished):
            self.stats.problems.append(f"valid request amid the fuzz got {reply!r}")
        elif reply.output_ids != self.expected_ids:
            self.stats.problems.append(f"valid request amid the fuzz: {reply.output_ids} != {self.expected_ids}")

    def settle(self, idle_check: Any, timeout: float = 120.0) -> None:
        """Drain replies to accepted fuzz generates until `idle_check()` is true (the runtime is idle)."""
        deadline = time.monotonic() + timeout
        while not idle_check():
            if time.monotonic() > deadline:
                self.stats.problems.append("the runtime did not become idle after the fuzz")
                return
            self._drain_until(self.fuzz, "", 0.2)
