"""Property-based fuzzing (hypothesis, bounded): the protocol decoder, request validation on the real tiny
model, and a live server fed hostile frames while valid traffic must keep getting the unloaded answer.
scripts/fuzz_protocol.py runs the same strategies for tens of thousands of messages.
"""

from __future__ import annotations

import threading

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from sgl_lite.runtime import protocol
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.server.event_loop import RuntimeServer
from sgl_lite.testing.fuzz import FuzzSession, frame_lists, payloads, request_dicts, run_fuzzed_request

pytestmark = pytest.mark.timeout(600)

FUZZ_SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VALID_PROMPT = "The quick brown fox"
VALID_PARAMS = {"max_new_tokens": 4, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    model = tiny_llama_dir
    # A short context bounds what an accepted fuzz request can cost.
    with Engine(model_path=str(model), dtype="float32", device="cpu", context_length=96, max_total_tokens=1024) as eng:
        yield eng


@settings(max_examples=400, **FUZZ_SETTINGS)
@given(payloads())
def test_decoders_accept_or_name_the_problem(payload):
    for decode in (protocol.decode_request, protocol.decode_reply):
        try:
            msg = decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            assert str(e)
        else:
            assert isinstance(msg, msgspec.Struct) and isinstance(msg.rid, str)


def test_request_validation_admits_only_what_runs(engine):
    outcomes = {"refused": 0, "ran": 0, "not_generate": 0}

    @settings(max_examples=250, **FUZZ_SETTINGS)
    @given(request_dicts())
    def check(fields):
        outcomes[run_fuzzed_request(engine.core, fields)] += 1

    check()
    assert outcomes["refused"] > 0 and outcomes["ran"] > 0, outcomes


def test_server_survives_fuzz_and_keeps_answering_valid_traffic(engine, tmp_path):
    expected = engine.generate(VALID_PROMPT, dict(VALID_PARAMS))["output_ids"]
    args = engine.args.replace(host=f"ipc://{tmp_path / 'fuzz.sock'}", max_message_bytes=1024)
    server = RuntimeServer(engine.core, args)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    session = FuzzSession(server.address, VALID_PROMPT, VALID_PARAMS, expected, valid_every=20)
    scheduler = engine.core.scheduler

    @settings(max_examples=300, **FUZZ_SETTINGS)
    @given(frame_lists())
    def fuzz(frames):
        session.send(frames)

    try:
        fuzz()
        session.check_valid()
        session.settle(lambda: not scheduler.has_work())
        assert thread.is_alive(), "the server died"
    finally:
        session.close()
        server.request_shutdown()
        thread.join(30)
    stats = session.stats
    print("fuzz:", stats.messages, "messages,", stats.errors, "error replies,", stats.valid_checks, "valid checks")
    assert stats.problems == [], stats.problems[:10]
    assert stats.messages >= 300 and stats.valid_checks >= 15
    scheduler.check_invariant()


def test_a_denormal_temperature_is_greedy_not_nan(engine):
    """Found by the fuzz: temperature 2e-309 passed validation and turned the probabilities into NaN."""
    greedy = engine.generate(VALID_PROMPT, {"max_new_tokens": 6, "temperature": 0.0})
    tiny = engine.generate(VALID_PROMPT, {"max_new_tokens": 6, "temperature": 2.2e-309, "top_p": 0.5, "min_p": 0.5})
    assert tiny["output_ids"] == greedy["output_ids"]
    constrained = engine.generate(VALID_PROMPT, {"max_new_tokens": 6, "temperature": 2.2e-309, "regex": "(yes|no)"})
    assert constrained["meta_info"]["finish_reason"]["type"] != "abort" and constrained["text"] in ("yes", "no")
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(VALID_PROMPT, {"max_new_tokens": 2, "temperature": 1e39})


def test_the_smallest_repetition_penalty_allowed_keeps_probabilities_finite(engine):
    """Found the same way: repetition_penalty 1e-300 is 0 in float32, and -inf * 0 is NaN."""
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine.generate(VALID_PROMPT, {"max_new_tokens": 2, "repetition_penalty": 1e-300})
    for temperature in (0.0, 1.0):
        out = engine.generate(VALID_PROMPT, {"max_new_tokens": 6, "temperature": temperature, "seed": 1,
                                             "repetition_penalty": 1e-6, "regex": "(yes|no)"})
        assert out["meta_info"]["finish_reason"]["type"] != "abort" and out["text"] in ("yes", "no")
