"""Jump-forward decoding of grammar-forced text (sampling/jump_forward.py, managers/scheduler_decode.py).

What is checked: the retokenization rule at the boundary; outputs stay valid for JSON schemas (fixed
keys, enums, nested objects), a regex and a tool call's structural tag, in fewer forwards; streams add
up to the final output; jumps that cross max_new_tokens or a stop string end exactly there; jumped
tokens carry no logprob; no KV leaks under retraction, aborts and n-gram speculation; the flag, the
meta_info field and the metric. Greedy output against the output without jump-forward, on the default
model: test_jump_forward_greedy.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import click
import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

from sgl_lite.cli import build_server_args, server_arg_options
from sgl_lite.http.openai_api.tool_parsers import PARSERS
from sgl_lite.http.openai_api.tools import ToolRequest
from sgl_lite.http.sglang_metrics import SglangMetrics
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.grammar import GrammarBackend, GrammarMatcher
from sgl_lite.runtime.sampling.jump_forward import RETOKENIZE_TAIL_TOKENS, JumpForward, move_matcher
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.server_args import ServerArgs

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 12},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "priority": {"enum": ["low", "high"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"]},
        "express": {"type": "boolean"},
    },
    "required": ["customer", "status", "priority", "address", "express"],
}
DATE_REGEX = r"Date: (19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]), status: (confirmed|cancelled)\."
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
LITERAL_REGEX = r"[a-z]The quick brown fox jumps over the lazy dog\."


def tool_call_tag() -> str:
    request = ToolRequest([WEATHER_TOOL], "required", None, False, PARSERS["qwen25"], True)
    return json.dumps(request.structural_tag())


def valid_tool_calls(text: str) -> bool:
    calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
    for call in calls:
        parsed = json.loads(call)
        assert parsed["name"] == "get_weather"
        jsonschema.validate(parsed["arguments"], WEATHER_TOOL["function"]["parameters"])
    return bool(calls) and text.strip() == "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


def valid_order(text: str) -> bool:
    jsonschema.validate(json.loads(text), ORDER_SCHEMA)
    return True


# (name, constraint, prompt, validity check)
CASES = [
    ("json_schema", {"json_schema": json.dumps(ORDER_SCHEMA)}, "Extract the order as JSON: Ann ordered two lamps, "
     "shipped today to Oslo 0150, high priority, express.", valid_order),
    ("regex", {"regex": DATE_REGEX}, "When was it booked? It was booked on 2024-03-05 and confirmed.",
     lambda text: re.fullmatch(DATE_REGEX, text) is not None),
    ("tool_call", {"structural_tag": None}, "What is the weather in Paris, in celsius?", valid_tool_calls),
]


def constraint_of(case: tuple) -> dict:
    constraint = case[1]
    return {"structural_tag": tool_call_tag()} if "structural_tag" in constraint else constraint


# ------------------------------------------------------------------ the retokenization rule (no model)


def ids_of(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def name_age_matcher(backend: GrammarBackend) -> GrammarMatcher:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    return backend.request_matcher(SamplingParams(json_schema=json.dumps(schema))).result(timeout=60)


def accept_all(matcher: GrammarMatcher, tokens: Sequence[int]) -> None:
    for token in tokens:
        assert matcher.accept_token(token), token


def test_a_jump_retokenizes_the_boundary_as_the_tokenizer_writes_the_whole_text(tiny_backend, tiny_tokenizer) -> None:
    matcher = name_age_matcher(tiny_backend)
    # The model closed the string with `"` alone; the grammar then forces `, "age": `.
    output = ids_of(tiny_tokenizer, '{"name": "Alice') + ids_of(tiny_tokenizer, '"')
    accept_all(matcher, output)
    assert matcher.jump_forward_string() == ', "age": '
    jump = JumpForward(tiny_tokenizer).find(matcher, ids_of(tiny_tokenizer, "Hi"), output, floor=0)
    assert jump is not None and jump.text == ', "age":'  # the trailing space is left to the model (` 4`)
    whole = ids_of(tiny_tokenizer, '{"name": "Alice", "age":')
    assert jump.keep == len(output) - 1  # the sampled `"` is replaced ...
    assert output[: jump.keep] + jump.tokens == whole  # ... by the tokenizer's own tokens for the whole text
    assert tiny_tokenizer.decode(jump.tokens) == '", "age":'
    assert move_matcher(matcher, output[jump.keep:], jump.tokens)
    accept_all(matcher, ids_of(tiny_tokenizer, " 42}"))
    assert matcher.is_completed()


def test_a_jump_never_replaces_tokens_below_its_floor(tiny_backend, tiny_tokenizer) -> None:
    matcher = name_age_matcher(tiny_backend)
    output = ids_of(tiny_tokenizer, '{"name": "Alice') + ids_of(tiny_tokenizer, '"')
    accept_all(matcher, output)
    finder = JumpForward(tiny_tokenizer)
    jump = finder.find(matcher, [], output, floor=len(output))  # e.g. everything was streamed already
    assert jump is not None and jump.keep == len(output)
    assert jump.tokens == ids_of(tiny_tokenizer, ', "age":')
    # Without a floor, only the last RETOKENIZE_TAIL_TOKENS may change (a stream holds back as many).
    assert finder.find(matcher, [], output, floor=0).keep >= len(output) - RETOKENIZE_TAIL_TOKENS


def test_no_jump_over_partial_characters_or_for_a_tokenizer_that_adds_a_leading_space(tiny_backend, tiny_tokenizer) -> None:
    finder = JumpForward(tiny_tokenizer)
    shared_first_byte = tiny_backend.request_matcher(SamplingParams(regex="(é|ê)x")).result(timeout=60)
    assert shared_first_byte.jump_forward_string() == ""  # its forced byte is not a whole character
    assert finder.find(shared_first_byte, [5], [], floor=0) is None

    class LeadingSpace:  # SentencePiece-like: a fragment tokenized alone gets a space in front
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return tiny_tokenizer.encode(" " + text, add_special_tokens=False)

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).removeprefix(" ")

    matcher = name_age_matcher(tiny_backend)
    output = ids_of(tiny_tokenizer, '{"name": "Al')
    accept_all(matcher, output + ids_of(tiny_tokenizer, '"'))
    assert finder.find(matcher, [5], output + ids_of(tiny_tokenizer, '"'), floor=0) is not None
    assert JumpForward(LeadingSpace()).find(matcher, [5], output + ids_of(tiny_tokenizer, '"'), floor=0) is None


def test_move_matcher_leaves_the_state_as_it_was_when_the_grammar_refuses(tiny_backend, tiny_tokenizer) -> None:
    matcher = tiny_backend.request_matcher(SamplingParams(regex="[0-9]{3}-[0-9]{3}")).result(timeout=60)
    output = ids_of(tiny_tokenizer, "12")
    accept_all(matcher, output)
    refused = ids_of(tiny_tokenizer, "3x")
    assert not move_matcher(matcher, output[-1:], refused)
    accept_all(matcher, ids_of(tiny_tokenizer, "3-456"))  # still right after "12"
    assert matcher.is_completed()


# ------------------------------------------------------------------ the runtime (tiny random model)


@pytest.fixture(scope="module")
def tiny_engines(tiny_llama_dir: Path):
    common = dict(model_path=str(tiny_llama_dir), max_total_tokens=4096, max_running_requests=8, dtype="float32", device="cpu")
    on, off = Engine(**common), Engine(**common, disable_regex_jump_forward=True)
    yield on, off
    for engine in (on, off):
        engine.shutdown()


def forwards(engine: Engine, run) -> tuple[dict, int]:
    before = engine.core.scheduler.num_forward_steps
    out = run()
    return out, engine.core.scheduler.num_forward_steps - before


def assert_idle_without_leaks(*engines: Engine) -> None:
    for engine in engines:
        engine.core.scheduler.check_invariant()
        assert not engine.core.scheduler.has_work()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_constrained_output_stays_valid_in_fewer_forwards(tiny_engines, case) -> None:
    on, off = tiny_engines
    _, _, prompt, valid = case
    params = {"temperature": 0, "max_new_tokens": 160, **constraint_of(case)}
    jumped, jumped_forwards = forwards(on, lambda: on.generate(prompt, params))
    plain, plain_forwards = forwards(off, lambda: off.generate(prompt, params))
    for out in (jumped, plain):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert valid(out["text"]), out["text"]
    assert jumped["meta_info"]["jump_forward_tokens"] > 0
    assert plain["meta_info"]["jump_forward_tokens"] == 0  # --disable-jump-forward
    assert jumped_forwards < plain_forwards
    # Every output token was sampled in a forward or written by a jump (one token per forward here).
    assert jumped_forwards == jumped["meta_info"]["completion_tokens"] - jumped["meta_info"]["jump_forward_tokens"]
    again = on.generate(prompt, params)  # a cache hit (the first run left prompt and output in the tree)
    assert again["output_ids"] == jumped["output_ids"] and again["meta_info"]["cached_tokens"] > 0
    assert "jump_forward_tokens" not in on.generate(prompt, {"max_new_tokens": 2})["meta_info"]  # unconstrained
    assert on.core.scheduler.stats()["jump_forward_tokens_total"] >= jumped["meta_info"]["jump_forward_tokens"]
    assert_idle_without_leaks(on, off)


def test_a_jump_that_crosses_max_new_tokens_ends_exactly_there(tiny_engines) -> None:
    on, off = tiny_engines
    for max_new in (2, 5):
        params = {"temperature": 0, "max_new_tokens": max_new, "regex": LITERAL_REGEX}
        jumped, plain = on.generate("Say it:", params), off.generate("Say it:", params)
        assert jumped["meta_info"]["jump_forward_tokens"] > 0  # the literal was jumped, and cut
        for out in (jumped, plain):
            assert len(out["output_ids"]) == max_new
            assert out["meta_info"]["finish_reason"] == {"type": "length"}
            assert re.fullmatch(r"[a-z]", out["text"][0]) and "The quick brown fox jumps over the lazy dog.".startswith(out["text"][1:])
    assert_idle_without_leaks(on, off)


def test_a_jump_that_crosses_a_stop_string_ends_exactly_there(tiny_engines) -> None:
    on, off = tiny_engines
    params = {"temperature": 0, "max_new_tokens": 40, "regex": LITERAL_REGEX, "stop": ["brown"]}
    jumped, plain = on.generate("Say it:", params), off.generate("Say it:", params)
    assert jumped["meta_info"]["jump_forward_tokens"] > 0
    assert jumped["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"] == {"type": "stop", "matched": "brown"}
    assert jumped["text"] == plain["text"] and jumped["text"].endswith("The quick ")
    # The request ended on the token that completes the stop string, not after it.
    tokenizer = on.core.tokenizer
    assert "brown" in tokenizer.decode(jumped["output_ids"]) and "brown" not in tokenizer.decode(jumped["output_ids"][:-1])
    assert_idle_without_leaks(on, off)


def stream_through_core(engine: Engine, prompt: str, params: dict) -> tuple[str, list[int], dict, bool]:
    """What the server loop sends for a streamed request (event_loop._replies): the text deltas and ids
    of every step, then the last ones; and whether a jump replaced ids produced in an earlier step."""
    core = engine.core
    req = core.make_req("stream-1", prompt, None, params, stream=True)
    core.submit(req)
    state = core.stream_state(req)
    text, ids, history, rewritten = "", [], [], False
    while not req.finished:
        for changed in core.step():
            if changed is req:
                rewritten |= list(req.output_ids[: len(history)]) != history
                history = list(req.output_ids)
            if changed is req and not req.finished:
                delta = state.update(req.output_ids)
                if delta:
                    text += delta
                    ids += state.new_ids(req.output_ids)
    final = core.output_text(req)
    text += state.finish(final)
    ids += state.new_ids(req.output_ids)
    return text, ids, {"text": final, "output_ids": list(req.output_ids)}, rewritten


def test_streamed_text_and_ids_add_up_to_the_final_output(tiny_engines) -> None:
    on, _ = tiny_engines
    params = {"temperature": 0, "max_new_tokens": 160, "json_schema": json.dumps(ORDER_SCHEMA)}
    # Without a stop string, then with one that a jump crosses (the forced key "zip").
    for extra, must_rewrite in (({}, True), ({"stop": ["zip"]}, False)):
        text, ids, final, rewritten = stream_through_core(on, CASES[0][2], {**params, **extra})
        assert rewritten or not must_rewrite  # a jump replaced sampled tokens reported in an earlier step
        assert text == final["text"] and ids == final["output_ids"], extra
        chunks = list(on.generate(CASES[0][2], {**params, **extra}, stream=True))  # the Engine's: ids so far
        assert all(final["output_ids"][: len(c["output_ids"])] == c["output_ids"] for c in chunks)
        assert chunks[-1]["text"] == final["text"]
    assert final["text"].endswith('"city": "') is False and "zip" not in final["text"]
    assert_idle_without_leaks(on)


def test_jumped_tokens_have_no_logprobs(tiny_engines) -> None:
    on, _ = tiny_engines
    out = on.generate("Say it:", {"temperature": 0, "max_new_tokens": 40, "regex": LITERAL_REGEX},
                      return_logprob=True, top_logprobs_num=2)
    meta = out["meta_info"]
    chosen, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert [tok for _, tok, _ in chosen] == out["output_ids"] and len(tops) == len(chosen)
    unscored = [i for i, (lp, _, _) in enumerate(chosen) if lp is None]
    assert len(unscored) >= meta["jump_forward_tokens"] > 0
    assert all(tops[i] == [] for i in unscored)
    assert all(isinstance(chosen[i][0], float) and len(tops[i]) == 2 for i in range(len(chosen)) if i not in unscored)


def test_no_kv_leak_under_retraction_and_aborts(tiny_llama_dir: Path) -> None:
    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=180, max_running_requests=8, dtype="float32",
                    device="cpu", chunked_prefill_size=64, schedule_conservativeness=0.05)
    core, scheduler = engine.core, engine.core.scheduler
    params = {"temperature": 0, "max_new_tokens": 120, "json_schema": json.dumps(ORDER_SCHEMA)}
    reqs = [core.make_req(f"r{i}", f"Order {i}: Ann, Oslo.", None, params) for i in range(6)]
    for req in reqs:
        core.submit(req)
    steps = 0
    while core.has_work():
        core.step()
        scheduler.check_invariant()
        steps += 1
        if steps == 12:
            core.abort(reqs[-1].rid)
    assert scheduler.num_retractions > 0 and sum(r.jump_forward_tokens for r in reqs) > 0
    for req in reqs[:-1]:
        assert req.finished_reason.kind.value == "stop"
        valid_order(core.output_text(req))
    assert_idle_without_leaks(engine)
    engine.shutdown()


def test_ngram_speculation_sees_the_retokenized_tokens(tiny_llama_dir: Path) -> None:
    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, max_running_requests=8, dtype="float32",
                    device="cpu", speculative_algorithm="ngram")
    core = engine.core
    params = {"temperature": 0, "max_new_tokens": 160, "json_schema": json.dumps(ORDER_SCHEMA)}
    prompt = 'Copy: {"customer": "Ann", "status": "shipped", "priority": "high", "address": {"city": "Oslo", "zip": 150}}'
    reqs = [core.make_req(f"s{i}", prompt, None, params) for i in range(3)]
    for req in reqs:
        core.submit(req)
    while core.has_work():
        core.step()
        core.check_invariant()
        for req in core.scheduler.running:
            if req.spec_state is not None:  # the drafter's copy of the tokens is the request's own
                assert np.array_equal(req.spec_state.sync(req), np.array(req.fill_ids))
    assert sum(r.jump_forward_tokens for r in reqs) > 0 and sum(r.spec_verify_ct for r in reqs) > 0
    for req in reqs:
        valid_order(core.output_text(req))
    assert_idle_without_leaks(engine)
    engine.shutdown()


@click.command()
@server_arg_options
def parse_only(**values):
    click.echo(repr(build_server_args(values).disable_regex_jump_forward))


def test_the_flag_and_the_metric() -> None:
    assert ServerArgs().disable_regex_jump_forward is False  # on by default
    for argv, disabled in (([], "False"), (["--disable-jump-forward"], "True"), (["--disable-regex-jump-forward"], "True")):
        result = CliRunner().invoke(parse_only, argv)
        assert result.exit_code == 0 and result.output.strip() == disabled, (argv, result.output)
    metrics = SglangMetrics()
    metrics.update({"jump_forward_tokens_total": 7}, "m")
    samples = {s.name: s.value for family in metrics.collect() for s in family.samples}
    assert samples["sglang:jump_forward_tokens_total"] == 7
