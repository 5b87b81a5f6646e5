"""Reliability in-process: limits on input, tokenizing off the serve thread, and wire-level refusals."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_reliability import ScriptedRunner, make_core, serve, tokenizer  # noqa: F401 - serve, tokenizer are fixtures
from waiting import wait_until

from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError
from sgl_lite.runtime.server.core import RuntimeCore
from sgl_lite.runtime.server.event_loop import RuntimeServer
from sgl_lite.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(120)

# ---------------------------------------------------------------------------- limits on input


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(text="x" * 10**6), "characters"),
        (dict(input_ids=list(range(2, 300)) * 20), "context length"),
        (dict(input_ids=[5], sampling_params={"max_new_tokens": 5000}), "max_new_tokens"),
        (dict(input_ids=[5], top_logprobs_num=10**9, return_logprob=True), "top_logprobs_num"),
        (dict(input_ids=[5], top_logprobs_num=65, return_logprob=True), "top_logprobs_num must be in \\[0, 64\\]"),
        (dict(input_ids=[5], sampling_params={"stop_token_ids": [5] * 257}), "stop_token_ids"),
        (dict(input_ids=[5], logprob_start_len=-7, return_logprob=True), "logprob_start_len"),
        (dict(input_ids=[5], priority=2**63), "priority"),
        (dict(input_ids=[5], sampling_params={"seed": 2**64 - 1}), "seed"),
        (dict(input_ids=[5], sampling_params={"top_k": 2**64 - 1}), "top_k"),
        (dict(input_ids=[5], sampling_params={"stop": ["ok", ""]}), "stop strings"),
        (dict(input_ids=[5, 10**6]), "vocabulary"),
        (dict(input_ids=[]), "empty"),
    ],
    ids=["huge-text", "long-ids", "max-new", "top-logprobs", "top-logprobs-cap", "stop-token-ids", "logprob-start", "priority", "seed", "top-k",
         "empty-stop", "oov", "empty"],
)
def test_limits_are_refused_with_the_field_named(tokenizer, kwargs, named):
    core = make_core(tokenizer, ScriptedRunner(vocab_size=len(tokenizer), context_length=1024))
    sampling = kwargs.pop("sampling_params", {"max_new_tokens": 4})
    text, input_ids = kwargs.pop("text", None), kwargs.pop("input_ids", None)
    with pytest.raises(ValueError, match=named):
        core.scheduler.add_request(core.make_req("bad", text, input_ids, sampling, **kwargs))
    assert not core.scheduler.has_work()
    core.scheduler.check_invariant()


class _NoScanList(list):
    """A list whose elements must not be read: only its length is allowed."""

    def __iter__(self):
        raise AssertionError("the input_ids were scanned")

    def __getitem__(self, index):
        raise AssertionError("the input_ids were read")


def test_input_ids_longer_than_the_context_are_refused_by_length_before_any_scan(tokenizer):
    core = make_core(tokenizer, ScriptedRunner(vocab_size=len(tokenizer), context_length=1024))
    huge = _NoScanList([0] * 4096)
    with pytest.raises(ValueError, match="context length 1024"):
        core.submit(core.make_req("huge", None, huge, {"max_new_tokens": 4}))
    assert not core.has_work()


def test_the_wire_refuses_a_huge_input_ids_list_from_its_length():
    payload = protocol.encode(protocol.GenerateReq("r", input_ids=[0] * (protocol.MAX_PROMPT_TOKENS + 1)))
    with pytest.raises(Exception, match=r"length <= 1048576 - at `\$\.input_ids`"):
        protocol.decode_request(payload)


class _GatedTokenizer:
    """The tiny tokenizer, except that tokenizing a long text waits for `gate` and notes its thread."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self._inner, self.gate, self.threads = inner, gate, []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __call__(self, text, **kwargs):
        if len(text) > 1000:
            self.threads.append(threading.current_thread())
            self.gate.wait(30)
        return self._inner(text, **kwargs)


def _send_while_tokenizing(client, gated: _GatedTokenizer, text: str, params: dict,
                           **kwargs) -> tuple[threading.Thread, list[Any]]:
    """Send `text` from a thread; return once the runtime is tokenizing it (the sender, and a list that
    gets its answer or its error)."""
    outcome: list[Any] = []

    def send() -> None:
        try:
            outcome.append(client.generate(text, sampling_params=params, **kwargs))
        except BaseException as e:  # noqa: BLE001 - kept for the caller's assertions
            outcome.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    wait_until(lambda: gated.threads, "the long text to be tokenized", 10)
    return sender, outcome


def _gated_server(tokenizer, serve, tmp_path, context_length: int):
    """A served fake-runner core whose tokenizer blocks on long texts until its gate is set."""
    gate = threading.Event()
    gated = _GatedTokenizer(tokenizer, gate)
    core = RuntimeCore(ServerArgs(model_path="fake"), gated,
                       ScriptedRunner(vocab_size=len(tokenizer), context_length=context_length),
                       "fake", [tokenizer.eos_token_id])
    return gate, gated, core, serve(core, tmp_path)


def test_a_long_text_is_tokenized_off_the_serve_thread(tokenizer, serve, tmp_path):
    gate, gated, _, server = _gated_server(tokenizer, serve, tmp_path, context_length=1024)
    long_text = "word " * 1000  # 5000 characters: tokenized elsewhere, and too long for the context
    params = {"max_new_tokens": 4, "ignore_eos": True}
    with RuntimeClient(server.address, timeout=30) as client, RuntimeClient(server.address, timeout=30) as other:
        sender, outcome = _send_while_tokenizing(client, gated, long_text, params)
        # The long text's tokenizing is blocked: the serve loop must still serve a short request.
        short = other.generate("hi", sampling_params=params)
        assert not gate.is_set() and len(short.output_ids) == 4
        gate.set()
        sender.join(30)
    assert gated.threads[0] is not server_thread(server)
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeRequestError) and "context length" in str(outcome[0])


def test_a_prompt_aborted_while_it_is_tokenized_never_runs(tokenizer, serve, tmp_path):
    gate, gated, core, server = _gated_server(tokenizer, serve, tmp_path, context_length=8192)
    with RuntimeClient(server.address, timeout=30) as client:
        sender, outcome = _send_while_tokenizing(client, gated, "word " * 1000, {"max_new_tokens": 4}, rid="long")
        client.abort("long")
        sender.join(30)
        assert len(outcome) == 1 and outcome[0].output_ids == [] and outcome[0].text == ""
        assert outcome[0].meta_info["finish_reason"] == {"type": "abort", "message": "aborted by the client"}
        gate.set()  # its tokenizing ends now, for nobody
        assert client.generate("hi", sampling_params={"max_new_tokens": 2}).output_ids
    assert core.scheduler.prompt_tokens_total == len(tokenizer("hi")["input_ids"])  # only "hi" ever ran


def server_thread(server: RuntimeServer) -> threading.Thread:
    return next(t for t in threading.enumerate() if getattr(t, "_target", None) == server.serve_forever)


def test_empty_rid_is_refused_on_the_wire():
    with pytest.raises(Exception, match=r"\$\.rid"):
        protocol.decode_request(protocol.encode(protocol.HealthReq("")))
