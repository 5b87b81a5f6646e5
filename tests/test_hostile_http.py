"""Hostile and careless HTTP clients (issue 16 items 3, 4, 7, 8, 11): limits with clear statuses,
abort on disconnect, 400 rather than 500 for unencodable values, slowloris, /openapi.json behind the key.

One tiny-model Engine core is served by a RuntimeServer thread and an HTTP front (uvicorn in a
thread) on loopback; steps are slowed where a request must stay in flight long enough to be seen.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Iterator

import httpx2
import pytest
from test_hostile_grammar import SELF_REFERENCE, raise_caps
from test_hostile_wire import SERVER_ARGS, ServerThread
from waiting import wait_until

from sgl_lite.http.app import create_app
from sgl_lite.http.chat_template import ChatTemplate
from sgl_lite.http.guards.limits import HttpLimits
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.server_args import warn_if_exposed
from sgl_lite.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(240)

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = HttpLimits(max_request_body_bytes=1024 * 1024, max_chat_messages=8, max_request_fanout=16)


class Front:
    def __init__(self, engine: Engine, address: str) -> None:
        self.engine = engine
        self.runtime = ServerThread(engine, address)
        self.client = RuntimeClient(self.runtime.address, timeout=60)
        self.http = HttpServerThread(create_app(self.client, api_key=KEY, limits=LIMITS), header_timeout_s=1.0)

    def post(self, path: str, body: object, **kw: object) -> httpx2.Response:
        return httpx2.post(self.http.url + path, json=body, headers=AUTH, timeout=60, **kw)

    def post_raw(self, path: str, content: bytes) -> httpx2.Response:
        return httpx2.post(self.http.url + path, content=content, timeout=60,
                           headers={**AUTH, "Content-Type": "application/json"})

    def live(self) -> int:
        stats = self.engine.core.scheduler.stats()
        return stats["num_running"] + stats["num_waiting"] + stats["num_grammar_pending"]

    def wait_idle(self, wait_s: float) -> float:
        start = time.monotonic()
        while self.live():
            assert time.monotonic() - start < wait_s, f"still {self.live()} request(s) live"
            time.sleep(0.05)
        return time.monotonic() - start

    def close(self) -> None:
        self.http.stop()
        self.client.close()
        self.runtime.stop()


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Engine]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    with Engine(model_path=str(model), **SERVER_ARGS) as eng:
        yield eng


@pytest.fixture
def front(engine, tmp_path) -> Iterator[Front]:
    f = Front(engine, f"ipc://{tmp_path / 'rt.sock'}")
    yield f
    f.close()


def slow_steps(engine: Engine, monkeypatch, seconds: float = 0.05) -> None:
    real_step = engine.core.scheduler.step

    def slow_step():
        time.sleep(seconds)
        return real_step()

    monkeypatch.setattr(engine.core.scheduler, "step", slow_step)


# ---------------------------------------------------------------------------- item 4: fan-out


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": ["hi"] * 17, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 17, "max_tokens": 1}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17, "max_tokens": 1}, "n"),
    ("/generate", {"text": ["hi"] * 17, "sampling_params": {"max_new_tokens": 1}}, "text"),
])
def test_fanout_over_the_limit_is_refused_before_anything_runs(front, path, body, param):
    steps_before = front.engine.core.scheduler.num_forward_steps
    r = front.post(path, body)
    assert r.status_code == 400, r.text
    assert "--max-request-fanout 16" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == param
    assert front.engine.core.scheduler.num_forward_steps == steps_before


# ---------------------------------------------------------------------------- item 8: body and chat size


def test_a_body_over_the_limit_gets_413(front):
    big = {"prompt": "x" * (1100 * 1024), "max_tokens": 1}
    r = front.post("/v1/completions", big)
    assert r.status_code == 413 and "--max-request-body-bytes 1048576" in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        yield b'{"prompt": "'
        for _ in range(1100):
            yield b"x" * 1024
        yield b'", "max_tokens": 1}'

    r = httpx2.post(front.http.url + "/v1/completions", content=chunks(), timeout=60,
                    headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert front.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_too_many_chat_messages_get_400(front):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 4 + [{"role": "user", "content": "x"}]
    r = front.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and "--max-chat-messages 8" in r.json()["error"]["message"]


def test_a_large_body_is_parsed_and_served(front):
    r = front.post("/v1/completions", {"prompt": "hello " * 9000, "max_tokens": 1})  # over the inline-parse size
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]  # parsed, then refused by the runtime


def test_tool_call_arguments_nested_past_the_parser_are_no_internal_error(front):
    # JSON nested past Python's recursion limit (sent on as the string it is), within the context's characters
    deep = "[" * 1500 + "]" * 1500
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    r = front.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_a_chat_with_bad_sampling_fields_is_refused_before_its_template_is_rendered(front, monkeypatch):
    def no_render(*args, **kwargs):
        raise AssertionError("the chat template was rendered for a request refused anyway")

    monkeypatch.setattr(ChatTemplate, "prompt", no_render)
    messages = [{"role": "user", "content": "hi " * 20_000}]
    for extra, param in (({"stop": [f"s{i}" for i in range(300)]}, "stop"), ({"n": 17}, "n"),
                         ({"logit_bias": {"five": 1.0}}, "logit_bias")):
        r = front.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------------- item 7: disconnects


def _send_and_hang_up(front: Front, path: str, body: dict, until) -> None:
    payload = json.dumps(body).encode()
    with socket.create_connection((front.http.host, front.http.port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_until(until, "the request to get going")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 400, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}),
])
def test_a_non_streaming_request_is_aborted_when_its_client_disconnects(front, engine, monkeypatch, path, body):
    slow_steps(engine, monkeypatch, 0.1)  # 400 tokens would take 40 s
    _send_and_hang_up(front, path, body, lambda: engine.core.scheduler.stats()["num_running"] == 1)
    # well under a second when idle; the bound leaves room for a loaded CI box (5 s was missed once)
    assert front.wait_idle(15.0) < 15.0


def test_a_stream_waiting_for_its_first_event_is_aborted_when_its_client_disconnects(front, engine, monkeypatch):
    raise_caps(engine, monkeypatch)
    slow = {"enum": [f"value-number-{i}" for i in range(30_000)]}  # compiles for tens of seconds
    body = {"prompt": "hi", "max_tokens": 4, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": slow}}}
    _send_and_hang_up(front, "/v1/completions", body, lambda: engine.core.scheduler.stats()["num_grammar_pending"] == 1)
    assert front.wait_idle(5.0) < 5.0


# ---------------------------------------------------------------------------- item 11: 400 not 500


WIDE = 2**70


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": WIDE}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": WIDE}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": WIDE}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_k": WIDE}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [WIDE]}),
    ("/v1/completions", {"prompt": [1, 2, WIDE], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "min_tokens": WIDE}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": WIDE}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "seed": -WIDE}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "seed": WIDE}}),
    ("/generate", {"input_ids": [1, WIDE], "sampling_params": {"max_new_tokens": 1}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "logprob_start_len": WIDE}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1,
                         "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "maximum": WIDE}}}}),
])
def test_integers_wider_than_64_bits_get_400(front, path, body):
    r = front.post(path, body)
    assert r.status_code == 400, r.text
    assert "64" in r.json()["error"]["message"]
    assert front.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udc00"], "max_tokens": 1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}'),
    ("/generate", b'{"text": "\\udfff", "sampling_params": {"max_new_tokens": 1}}'),
])
def test_lone_surrogates_get_400(front, path, raw):
    r = front.post_raw(path, raw)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]


def test_a_surrogate_pair_is_fine(front):
    r = front.post_raw("/v1/completions", b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("schema, named", [
    ({"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}, SELF_REFERENCE),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "only local references"),
])
def test_bad_refs_in_a_schema_get_400(front, schema, named):
    body = {"prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    for stream in (False, True):
        r = front.post("/v1/completions", {**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert re.search(named, r.json()["error"]["message"]), r.text


def test_a_long_rid_gets_400(front):
    r = front.post("/generate", {"text": "hi", "rid": "r" * 100_000, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]


def test_every_500_is_logged(tmp_path, caplog):
    client = RuntimeClient(f"ipc://{tmp_path / 'nobody.sock'}", timeout=2, health_timeout=1)
    http = HttpServerThread(create_app(client))
    try:
        with caplog.at_level(logging.WARNING, logger="sgl_lite.http.app"):
            r = httpx2.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        assert r.status_code == 500
        assert any("/v1/completions: 500" in rec.getMessage() for rec in caplog.records)
    finally:
        http.stop()
        client.close()


def test_openapi_needs_the_key(front):
    assert httpx2.get(front.http.url + "/openapi.json", timeout=10).status_code == 401
    assert httpx2.get(front.http.url + "/docs", timeout=10).status_code in (401, 404)
    r = httpx2.get(front.http.url + "/openapi.json", headers=AUTH, timeout=10)
    assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]


def test_a_wrong_key_is_refused_before_the_body_is_read(front):
    """A caller without the key cannot make the front buffer (or wait up to a minute for) a body."""
    for auth in ("", "Authorization: Bearer wrong\r\n"):
        with socket.create_connection((front.http.host, front.http.port), timeout=10) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                         f"Content-Length: {LIMITS.max_request_body_bytes}\r\n\r\n".encode())  # and no body
            start = time.monotonic()
            chunks = []
            while data := sock.recv(65536):  # the guard closes the connection after its answer
                chunks.append(data)
            answer = b"".join(chunks).decode(errors="replace")
            assert answer.startswith("HTTP/1.1 401") and "invalid_api_key" in answer, answer
            assert time.monotonic() - start < 5.0


def test_slow_headers_are_cut_off(front):
    with socket.create_connection((front.http.host, front.http.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(10)
        start = time.monotonic()
        for _ in range(8):  # a header line every half second: never complete
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
            time.sleep(0.5)
        assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - start < 6.0


def test_serving_beyond_loopback_without_a_key_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="sgl_lite.runtime.server_args"):
        warn_if_exposed("0.0.0.0", None, "the runtime")
        warn_if_exposed("192.168.1.5", None, "the HTTP API")
        warnings = len(caplog.records)
        warn_if_exposed("0.0.0.0", "key", "the runtime")
        warn_if_exposed("127.0.0.1", None, "the runtime")
        warn_if_exposed("::1", None, "the runtime")
        warn_if_exposed("ipc:///tmp/x.sock", None, "the runtime")
    assert warnings == 2 and len(caplog.records) == 2
    assert "0.0.0.0 without an API key" in caplog.records[0].getMessage()
