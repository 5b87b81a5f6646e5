"""SGLang's stop_regex, logit_bias, null max_new_tokens and their checks, on the tiny random model.

The tiny model's greedy output is one byte token over and over, so outputs with content are made with
logit_bias itself: seeded sampling among three biased tokens (" 1", " 2", " 3"). Expected results come
from the same request without the stop (its tokens, decoded by the model's tokenizer), never from constants.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from sgl_lite.lang.backend.http_runtime import generate_body
from sgl_lite.lang.ir import SglSamplingParams
from sgl_lite.runtime.managers.request import FinishKind, Req
from sgl_lite.runtime.managers.stop_checker import StopChecker, StopRegexes
from sgl_lite.runtime.protocol import MAX_LOGIT_BIAS_TOKENS, SamplingParams, sampling_params_from_dict
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.stop_regex import MAX_STOP_REGEX_BYTES, MAX_STOP_REGEX_COUNT, is_plain_text, longest_match_chars

CONTEXT = 96
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path):
    eng = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, dtype="float32", device="cpu",
                 context_length=CONTEXT)
    yield eng
    eng.shutdown()
    eng.core.scheduler.check_invariant()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def digits(tokenizer: Any) -> dict[str, Any]:
    """Seeded sampling among " 1", " 2", " 3" (each biased by +100): the request, and its free output."""
    bias = {str(tokenizer.convert_tokens_to_ids(f"\u0120{d}")): 100.0 for d in "123"}
    return {"temperature": 1.0, "seed": 7, "max_new_tokens": 24, "ignore_eos": True, "logit_bias": bias}


def first_match_prefix(tokenizer: Any, ids: list[int], pattern: str) -> int:
    """The fewest leading tokens whose text holds a match of `pattern` (where SGLang's request stops)."""
    return next(n for n in range(1, len(ids) + 1) if re.search(pattern, tokenizer.decode(ids[:n])))


# ---------------------------------------------------------------- logit_bias


def test_a_large_bias_makes_greedy_pick_the_token(engine: Engine) -> None:
    greedy = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})["output_ids"]
    target = next(t for t in range(5, 384) if t not in greedy)
    biased = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True,
                                      "logit_bias": {str(target): 100}})
    assert biased["output_ids"] == [target] * 6
    # Sampled too: +100 leaves the others no probability worth the name.
    sampled = engine.generate(PROMPT, {"temperature": 1.0, "seed": 3, "max_new_tokens": 6, "ignore_eos": True,
                                       "logit_bias": {target: 100}})  # an int key, as a Python caller writes it
    assert sampled["output_ids"] == [target] * 6


def test_a_negative_bias_hands_the_step_to_the_runner_up(engine: Engine) -> None:
    free = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 1}, return_logprob=True, top_logprobs_num=2)
    (_, top, _), (_, runner_up, _) = free["meta_info"]["output_top_logprobs"][0]
    assert free["output_ids"] == [top]
    banned = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 1, "logit_bias": {str(top): -100}})
    assert banned["output_ids"] == [runner_up]


def test_speculative_verification_adds_the_bias_too(tiny_llama_dir: Path, engine: Engine, digits) -> None:
    # A biased output repeats itself, so n-gram drafts come; verified, they must give plain decoding's tokens.
    spec = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, dtype="float32", device="cpu",
                  context_length=CONTEXT, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    try:
        for params in ({"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "logit_bias": {"100": 100}},
                       digits):
            drafted = spec.generate(PROMPT, params)
            assert drafted["output_ids"] == engine.generate(PROMPT, params)["output_ids"]
            assert drafted["meta_info"].get("spec_verify_ct", 0) > 0  # drafts were verified
    finally:
        spec.shutdown()


def test_logit_bias_values_are_checked_with_the_field_named(engine: Engine) -> None:
    for bias, says in [({"384": 1.0}, "outside the vocabulary"), ({"x": 1.0}, "decimal digits"),
                       ({"-1": 1.0}, "decimal digits"), ({"5": float("nan")}, "finite"), ({"5": 1e31}, "finite"),
                       ({str(i): 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}, str(MAX_LOGIT_BIAS_TOKENS))]:
        with pytest.raises(ValueError, match="logit_bias") as refused:
            engine.generate(PROMPT, {"max_new_tokens": 1, "logit_bias": bias})
        assert says in str(refused.value)
    with pytest.raises(ValueError, match="logit_bias"):
        sampling_params_from_dict({"logit_bias": {"5": "high"}})


# ---------------------------------------------------------------- stop_regex


def test_stop_regex_stops_at_the_token_that_completes_a_match_and_keeps_it(engine, tokenizer, digits) -> None:
    free = engine.generate(PROMPT, digits)
    pattern = r"\d [23]"
    n = first_match_prefix(tokenizer, free["output_ids"], pattern)
    assert 1 < n < len(free["output_ids"])  # the seed gives a match in the middle
    stopped = engine.generate(PROMPT, {**digits, "stop_regex": [r"x\d{3}", pattern]})
    assert stopped["output_ids"] == free["output_ids"][:n]
    assert stopped["text"] == tokenizer.decode(free["output_ids"][:n])  # SGLang keeps a regex's match
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_a_plain_text_pattern_is_cut_like_a_stop_string(engine, tokenizer, digits) -> None:
    free = engine.generate(PROMPT, digits)
    n = first_match_prefix(tokenizer, free["output_ids"], r"\d [23]")
    plain = re.search(r"\d [23]", tokenizer.decode(free["output_ids"][:n])).group(0)
    assert is_plain_text(plain)
    as_regex = engine.generate(PROMPT, {**digits, "stop_regex": plain})
    as_stop = engine.generate(PROMPT, {**digits, "stop": plain})
    assert as_regex["text"] == as_stop["text"] and not as_regex["text"].endswith(plain)
    assert as_regex["meta_info"]["finish_reason"] == {"type": "stop", "matched": plain}
    kept = engine.generate(PROMPT, {**digits, "stop_regex": plain, "no_stop_trim": True})
    assert kept["text"].endswith(plain)
    # Streamed, no chunk shows text the final answer cuts.
    chunks = list(engine.generate(PROMPT, {**digits, "stop_regex": plain}, stream=True))
    assert chunks[-1]["text"] == as_regex["text"]
    assert all(as_regex["text"].startswith(c["text"]) for c in chunks)


def test_min_new_tokens_holds_stop_regex_like_a_stop_string(engine, tokenizer, digits) -> None:
    free = engine.generate(PROMPT, digits)
    n = first_match_prefix(tokenizer, free["output_ids"], r"\d")
    held = engine.generate(PROMPT, {**digits, "stop_regex": r"\d \d", "min_new_tokens": 5})
    # Matches completed before the 5th token do not count later; the first one completed from then on does.
    later = next(k for k in range(5, 25) if re.search(r"\d \d$", tokenizer.decode(free["output_ids"][:k])))
    assert n < 5 and held["output_ids"] == free["output_ids"][:later]


def test_stop_regex_values_are_checked_with_the_field_named(engine: Engine) -> None:
    for value, says in [("(a", "not a valid regular expression"), ("", "empty"),
                        ("a" * (MAX_STOP_REGEX_BYTES + 1), "bytes"), (["a"] * (MAX_STOP_REGEX_COUNT + 1), "patterns")]:
        with pytest.raises(ValueError, match="stop_regex") as refused:
            engine.generate(PROMPT, {"max_new_tokens": 1, "stop_regex": value})
        assert says in str(refused.value)


def test_a_runaway_pattern_ends_its_request_with_a_bad_request(tokenizer: Any) -> None:
    # (a|aa)+$ backtracks exponentially over a run of a's that is not at the end.
    text = "a" * 40 + "!"
    with pytest.raises(TimeoutError, match="stop_regex"):
        StopRegexes(r"(a|aa)+$").first_ending_in(text, len(text) - 1)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    req = Req(rid="r", input_ids=[1], sampling_params=SamplingParams(max_new_tokens=100, stop_regex=r"(a|aa)+$"),
              output_ids=ids)
    reason = StopChecker(tokenizer, [], context_length=1000).check(req)
    assert reason is not None and reason.kind is FinishKind.ABORT and reason.error_code == "bad_request"
    assert "stop_regex" in (reason.message or "")


def test_the_dsl_sends_stop_regex() -> None:
    params = SglSamplingParams(stop_regex=[r"\d", "end"], max_new_tokens=8)
    assert params.to_runtime_params().stop_regex == [r"\d", "end"]
    assert generate_body("x", params)["sampling_params"]["stop_regex"] == [r"\d", "end"]  # over HTTP, SGLang's name


def test_longest_match_bounds_the_window() -> None:
    assert [longest_match_chars(p) for p in ("ab", "a|bcd", r"x{2,5}", r"[0-9]\d")] == [2, 3, 5, 2]
    assert longest_match_chars(r"\d+") == longest_match_chars(r"(a)\1") == 2**30
    assert StopRegexes(r"\d+").window_tokens == 1024 and StopRegexes("ab").window_tokens == 9
    assert is_plain_text("Paris") and is_plain_text("\n\n")
    assert not any(is_plain_text(p) for p in (r"\n", "Par.s", r"Paris\.", "(?i)paris"))


# ---------------------------------------------------------------- max_new_tokens null


def test_null_max_new_tokens_runs_up_to_the_context(engine: Engine) -> None:
    ids = engine.core.tokenizer(PROMPT)["input_ids"]
    out = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": None, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == CONTEXT - len(ids)
    assert out["meta_info"]["finish_reason"] == {"type": "length"}
    # min_new_tokens above what fits is lowered to it (SGLang's rule), not refused.
    held = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": None, "min_new_tokens": CONTEXT})
    assert held["meta_info"]["completion_tokens"] == CONTEXT - len(ids)
    # One params object for several prompts: each gets what fits its own prompt.
    shared = SamplingParams(max_new_tokens=None, temperature=0, ignore_eos=True)
    short, long = engine.generate(["a", PROMPT], [shared, shared])
    assert short["meta_info"]["completion_tokens"] == CONTEXT - len(engine.core.tokenizer("a")["input_ids"])
    assert long["meta_info"]["completion_tokens"] == CONTEXT - len(ids)
