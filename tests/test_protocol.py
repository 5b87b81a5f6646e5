"""The wire format: every message survives a round trip, and bad input is named precisely."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from sgl_lite.runtime import protocol
from sgl_lite.runtime.protocol import SamplingParams

REQUESTS = [
    protocol.GenerateReq("r1", text="hi", sampling_params=SamplingParams(max_new_tokens=3, temperature=0.0, stop=["\n"]),
                         stream=True, return_logprob=True, logprob_start_len=0, top_logprobs_num=2, priority=5),
    protocol.GenerateReq("r2", input_ids=[1, 2, 3], sampling_params=SamplingParams(json_schema={"type": "object"})),
    protocol.AbortReq("r1"),
    protocol.FlushCacheReq("f"),
    protocol.ServerInfoReq("s"),
    protocol.HealthReq("h"),
    protocol.GenerateReq("r3", input_ids=[4], session_pin=protocol.SessionPin("chat-1", 1800.0)),
    protocol.UnpinSessionReq("u", "chat-1"),
]
REPLIES = [
    protocol.TokenChunk("r1", "caf\u00e9", [5, 6], {"completion_tokens": 2}),
    protocol.Finished("r1", "text", [1, 2], {"finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3}),
    protocol.ErrorReply("r1", "temperature must be >= 0; got -1.0"),
    protocol.ErrorReply("", "nope", "unauthorized"),
    protocol.InfoReply("s", {"waiting": 0, "nested": {"a": [1, 2.5, None]}}),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg):
    assert protocol.decode_request(protocol.encode(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg):
    assert protocol.decode_reply(protocol.encode(msg)) == msg


def test_directions_do_not_mix():
    with pytest.raises(msgspec.ValidationError):
        protocol.decode_request(protocol.encode(protocol.InfoReply("x")))
    with pytest.raises(msgspec.ValidationError):
        protocol.decode_reply(protocol.encode(protocol.HealthReq("x")))


@pytest.mark.parametrize(
    "raw, named",
    [
        ({"type": "GenerateReq", "rid": 7}, "$.rid"),
        ({"type": "GenerateReq"}, "rid"),
        ({"type": "GenerateReq", "rid": "a", "sampling_params": {"temperature": "hot"}}, "$.sampling_params.temperature"),
        ({"type": "GenerateReq", "rid": "a", "sampling_params": {"tempurature": 0.5}}, "tempurature"),
        ({"type": "GenerateReq", "rid": "a", "colour": "red"}, "colour"),
        ({"type": "Launch", "rid": "a"}, "$.type"),
        ({"type": "GenerateReq", "rid": "a", "session_pin": {"id": "s", "idle_timeout_s": 0}}, "$.session_pin.idle_timeout_s"),
        ({"type": "GenerateReq", "rid": "a", "session_pin": {"id": "", "idle_timeout_s": 5}}, "$.session_pin.id"),
        ({"type": "UnpinSessionReq", "rid": "a"}, "session_id"),
    ],
)
def test_invalid_requests_name_the_field(raw, named):
    with pytest.raises(msgspec.ValidationError, match=named.replace("$", r"\$").replace(".", r"\.")):
        protocol.decode_request(msgspec.msgpack.encode(raw))


def test_garbage_bytes_raise_decode_errors():
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        protocol.decode_request(b"\xc1\xff\x00 not msgpack")


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 5}, "top_p"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"regex": "a", "ebnf": "b"}, "regex"),
    ],
)
def test_sampling_params_validation_names_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        protocol.sampling_params_from_dict(params)


def test_sampling_params_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="max_tokens"):
        protocol.sampling_params_from_dict({"max_tokens": 3})


def test_protocol_client_and_launcher_are_torch_free():
    code = "import sys, sgl_lite.runtime.protocol, sgl_lite.runtime.client, sgl_lite.lang.launcher; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
